"""A job's life beyond its client and its workers, on the client (SPEC §4.6): attaching
to a keep-alive coordinator after a kernel restart (``Coordinator.attach``), what it
had not read (``pending``), its datasets by label, the read receipts that keep a value
on the scheduler until it is fetched, and telling a worker its preemption deadline.

``JobLife`` is a half of ``Coordinator`` (as ``ClosureClient`` is): the class using it
sets what ``ClosureClient`` needs, and ``_begin(info)``, which starts a Coordinator on
an owner the scheduler handed out.
"""

from __future__ import annotations

import itertools
from typing import Any, TypeVar

from distributed import Client, get_client

from daskdist.client import reprs
from daskdist.client.closures import GangValues, PerWorkerValues, RemoteValue
from daskdist.client.datasets import DatasetCoordinator, PerWorkerDataset
from daskdist.core import checks
from daskdist.core.lifetime.keepalive import gang_of, is_gang, seq_of
from daskdist.core.protocol import Outcome
from daskdist.errors import CoordinatorClosedError

Life = TypeVar("Life", bound="JobLife")


class AttachedDataset(PerWorkerDataset):
    """A dataset of a coordinator, as ``Coordinator.datasets()`` finds it on the
    scheduler: its ``progress()`` (of its newest epoch by default) and iterators over
    its per-worker components (the handle that made it owns it: dropping this one
    releases nothing)."""

    def __init__(self, coordinator: DatasetCoordinator, dataset_id: str, name: str,
                 epoch: int) -> None:
        super().__init__(coordinator, PerWorkerValues(rid=dataset_id, kind="dataset"), name)
        self.epoch = int(epoch)
        self._bar: tuple[int, Any] | None = None  # (epoch, its progress bar), once shown

    def progress(self, epoch: int | None = None, bar: bool = False) -> dict:
        """The ``"dynamic"`` policy's counts of ``epoch`` (default: its newest): total,
        acknowledged, leased, free, complete; ``bar=True`` shows them on a bar."""
        p = super().progress(self.epoch if epoch is None else int(epoch))
        if bar:
            self._bar = reprs.update_epoch_bar(self._bar, p)
        return p

    def __repr__(self) -> str:
        return f"AttachedDataset({self.name!r}, {self.dataset_id}, epoch {self.epoch})"


class JobLife:
    """``Coordinator.attach``, ``pending``, ``datasets`` and ``notify_preemption``."""

    client: Client
    name: str
    _owner: str
    _token: str
    _rpc: Any
    _datasets: DatasetCoordinator  # what its dataset handles ask of it

    @classmethod
    def attach(cls: type[Life], client: Client | None, name: str) -> Life:
        """The keep-alive coordinator ``name`` (``Coordinator(client, name=name,
        keep_alive=True)``, made by any client of this scheduler, now gone or not), with
        this client as its owner: its closures, gangs and datasets went on meanwhile;
        :meth:`pending` gives what it had not read. The client that made it acts for it
        no more. ``dd.CoordinatorClosedError`` naming ``name`` when it closed (or was
        never made, or has no keep-alive owner)."""
        self = cls.__new__(cls)
        self._init_closures(None)
        self.client = client if client is not None else get_client()
        if self.client.asynchronous:
            raise TypeError("Coordinator needs a synchronous Client (asynchronous=False)")
        self.name = checks.text(name, "name")
        self._rpc = self.client.scheduler
        try:
            info = self._call("daskdist_attach", client=self.client.id)
        except LookupError as e:  # the name has no keep-alive owner
            raise CoordinatorClosedError(f"cannot attach: {e.args[0] if e.args else e}"
                                         ) from None
        if info is None:
            raise CoordinatorClosedError(f"cannot attach to coordinator {name!r}: the "
                                         f"daskdist scheduler plugin did not answer")
        if info.get("closed"):
            raise CoordinatorClosedError(
                f"cannot attach: coordinator {name!r} is not on this scheduler: it closed "
                f"(close(), or its keep_alive owner stayed unattached for "
                f"daskdist.coordinator.keep-alive-timeout), or never was")
        self._seq = itertools.count(int(info["seq"]))
        self._init_life(keep_alive=True)
        self._adopt(info)
        self._begin(info)
        return self

    def _init_life(self, keep_alive: bool) -> None:
        """``keep_alive``: each value read sends a receipt (the scheduler keeps it until
        then)."""
        self._reader = self._read if keep_alive else None
        self._unread: set[str] = set()  # adopted ids not read yet
        self._adopted: list[tuple[str, Any]] = []  # (id, value) adopted by attach()

    def _adopt(self, info: dict) -> None:
        """The values of what the previous client had not read: running ones resolve
        when they finish, finished ones at once."""
        kept = [Outcome._make(item) for item in info["kept"]]
        with self._cv:
            for cid in sorted([*info["closures"], *info["gangs"], *(o.cid for o in kept)],
                              key=lambda cid: seq_of(cid) or 0):
                gang = is_gang(cid)
                whole = RemoteValue(cid, None if gang else self, self._read)
                self._pending[cid] = whole
                if gang:
                    self._gangs[cid] = GangValues(whole)
                self._adopted.append((cid, self._gangs[cid] if gang else whole))
                self._unread.add(cid)
        for outcome in kept:
            self._resolve(outcome)

    def _read(self, cid: str) -> None:
        """A value was read: the scheduler keeps it no more (a one-way message)."""
        cid = gang_of(cid)
        self._unread.discard(cid)
        try:
            self.client.sync(self._rpc.daskdist_read, name=self.name, owner=self._owner,
                             token=self._token, cids=[cid], reply=False)
        except Exception:  # noqa: BLE001 - the scheduler or the coordinator is gone
            pass

    def pending(self) -> list:
        """What this owner's work has not given yet: the values of its unfinished
        closures and gangs (a gang's: its ``PerWorkerValues``), and, after
        :meth:`attach`, those that finished while no client read them; in schedule
        order. ``coord.fetch(coord.pending())`` waits for them all. A value is read
        once: one read by the client before (its ``fetch`` returned) is not here."""
        with self._cv:
            own = [(cid, self._gangs.get(cid) or rv) for cid, rv in self._pending.items()]
        adopted = {cid for cid, _ in self._adopted}
        return ([v for cid, v in self._adopted if cid in self._unread]
                + [v for cid, v in own if cid not in adopted])

    def datasets(self) -> dict[str, AttachedDataset]:
        """This owner's datasets, by label (``name=``; its id where it has none), each
        with ``progress()`` (its newest epoch)."""
        self._check_open()
        found = self._owned("daskdist_datasets")
        return {label or dataset_id: AttachedDataset(self._datasets, dataset_id, label, epoch)
                for dataset_id, label, epoch in found}

    def notify_preemption(self, worker: str, deadline: float,
                          reason: str = "notify_preemption") -> None:
        """Tell worker ``worker`` (an address, as ``members()`` lists them) that it will
        be taken away at ``deadline`` (epoch seconds, ``time.time()``): its closures see
        it as ``ctx.preemption``, it starts only closures expected to end before it, and
        its gang member leaves the group at its next commit, a ``checkpoint_to`` State
        writing a just-in-time checkpoint. No other worker hears of it."""
        self._check_open()
        self._owned("daskdist_notify_preemption", worker=worker, deadline=float(deadline),
                    reason=reason)
