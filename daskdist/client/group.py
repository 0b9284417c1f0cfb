"""Client-side description of a formed collective group.

A plain dataclass with no torch import, so the client (and anything that only
reports on a group) can hold it without touching torch. The lead's
``Coordinator.collective_group()`` returns one; the worker side uses
:class:`daskdist.collective.Group` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CollectiveGroup:
    """A torch.distributed group bootstrapped through Dask (SPEC §4).

    ``members`` are the worker addresses in rank order (rank ``i`` is ``members[i]``).
    """

    world_size: int
    generation: int
    members: tuple[str, ...] = field(default_factory=tuple)
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.members and len(self.members) != self.world_size:
            raise ValueError(
                f"{len(self.members)} members given for a group of world_size {self.world_size}"
            )

    def __repr__(self) -> str:
        return (
            f"CollectiveGroup(world_size={self.world_size}, generation={self.generation}, "
            f"backend={self.backend!r})"
        )

    def _repr_html_(self) -> str:
        from daskdist.client.reprs import group_html

        return group_html(self)
