"""Which worker holds which partition of a persisted collection (pure).

Built once per collection from the holders of its persisted keys (the scheduler plugin
asks Dask's ``who_has``); a member asking for a lease then gets a partition its own
worker holds, so it reads it from its own memory. Per ``(epoch, address)`` a cursor
walks that address's partitions (in a seeded order for a shuffled collection), so a
lease costs O(1) amortized, whatever the number of partitions; whether a partition is
still free, and still held there, is checked when it comes up (lazily), by callables
the caller passes. Imports nothing from Dask or the rest of the package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from daskdist.core.leases.partitions import Permutation

__all__ = ["LocalityIndex"]


class LocalityIndex:
    """Partitions by the address of a worker that held them when it was built."""

    def __init__(self, holders: Iterable[tuple[int, Iterable[str]]], seed: int = 0,
                 shuffle: bool = False, max_epochs: int = 8) -> None:
        self.by_address: dict[str, list[int]] = {}
        for unit, addresses in holders:
            for address in addresses:
                self.by_address.setdefault(address, []).append(int(unit))
        self.seed = seed
        self.shuffle = shuffle
        self.max_epochs = max_epochs
        self._cursors: dict[int, dict[str, int]] = {}  # epoch -> address -> position
        self._orders: dict[tuple[int, str], Permutation] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_address.values())

    def take(self, address: str, epoch: int, lease: Callable[[int], object],
             held_there: Callable[[int], bool]) -> object:
        """The first result of ``lease(unit)`` that is not ``None``, over the partitions
        ``address`` holds (``held_there(unit)``), from the epoch's cursor on; ``None``
        when none is left. The cursor moves past every partition tried."""
        units = self.by_address.get(address)
        if not units:
            return None
        cursors = self._cursors.get(epoch)
        if cursors is None:
            while len(self._cursors) >= self.max_epochs:  # the oldest epochs' go
                old = min(self._cursors)
                del self._cursors[old]
                for key in [k for k in self._orders if k[0] == old]:
                    del self._orders[key]
            cursors = self._cursors[epoch] = {}
        order = None
        if self.shuffle:
            order = self._orders.get((epoch, address))
            if order is None:
                order = self._orders[(epoch, address)] = Permutation(
                    len(units), self.seed, epoch, len(address))
        k = cursors.get(address, 0)
        try:
            while k < len(units):
                unit = units[order[k] if order is not None else k]
                k += 1
                if not held_there(unit):
                    continue
                got = lease(unit)
                if got is not None:
                    return got
            return None
        finally:
            cursors[address] = k
