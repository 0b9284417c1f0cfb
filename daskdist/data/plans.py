"""A loader's policy, as a small object the loader asks instead of branching on it.

- :class:`StaticPlan` (``"file"``, ``"row_group"``, ``"data"``, ``"auto"``, ``"off"``):
  this input pipeline's share of the source's units (:func:`.sharding.assign`, one
  place for files and partitions alike), read from a stream position; resumable by
  position.
- :class:`LeasedPlan` (``"dynamic"``): no share: rows are leased on demand
  (:class:`~.leased.LeasedPass`); a pass that found no free rows may run again, and the
  lease table holds the epoch's ledger (a ``state_dict`` position is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daskdist import config
from daskdist.data.leased.held import ConsumptionRate
from daskdist.data.leased.passes import LeasedPass
from daskdist.data.sharding import Piece, assign
from daskdist.data.sources import ChunkSource, Source, SourceReader

__all__ = ["LeasedPlan", "StaticPlan", "make_plan"]


class StaticPlan:
    """A static policy's share of ``source``'s units for one pipeline."""

    leased = False

    def __init__(self, source: Source, asked: str, pipeline: tuple[int, int]) -> None:
        self.source = source
        self.asked = asked  # as given: "auto" resolves anew at each split
        self.policy = asked
        self.pipeline = (-2, 0)
        self.pieces: list[Piece] = []
        self.split(pipeline)

    def split(self, pipeline: tuple[int, int], before: Callable[[], None] = lambda: None
              ) -> None:
        """Read pipeline ``pipeline[0]`` of ``pipeline[1]``'s share from now on (id -1:
        none, a worker that joined after its dataset's epoch was split); ``before`` runs
        first when that changes the share."""
        if pipeline == self.pipeline:
            return
        before()
        self.pipeline = pipeline
        i, n = pipeline
        if i < 0:
            self.pieces = []
            return
        self.policy, self.pieces = assign(self.source.unit_groups(), self.source.unit_rows(),
                                          n, i, self.asked)

    def num_rows(self) -> int:
        """Rows this pipeline reads per epoch (``TypeError`` while lengths are unknown)."""
        if any(p.num_rows is None for p in self.pieces):
            raise TypeError(f"the {self.source.what} has partitions of unknown length "
                            "(learned as they are computed, never by a pass first)")
        return sum(p.rows for p in self.pieces)

    def length(self, batch_size: int, drop_last: bool) -> int:
        n = self.num_rows()
        return n // batch_size if drop_last else -(-n // batch_size)

    def open(self, reader: SourceReader, epoch: int, position: int,
             define: Callable[[], None], outside: bool) -> ChunkSource:
        """A pass over this pipeline's pieces from stream ``position``."""
        return reader.static_pass(epoch, position, self.pieces)

    def position(self, consumed: int) -> int:
        return int(consumed)

    def check_pipeline(self, state: dict) -> None:
        mine = list(self.pipeline)
        if list(state.get("pipeline", mine)) != mine:
            raise ValueError(f"state is for pipeline {state['pipeline']}, this is {mine}")

    def progress(self, define: Callable[[], None], dataset_id: str, epoch: int,
                 position: int) -> dict:
        """This pipeline's own rows consumed against its total."""
        total = self.num_rows()
        return {"total": total, "consumed": position, "complete": position >= total}


class LeasedPlan:
    """``"dynamic"``: every row of the epoch goes to exactly one completed closure."""

    leased = True
    policy = "dynamic"

    def __init__(self, source: Source, services: Any, drop_last: bool,
                 pipeline: tuple[int, int]) -> None:
        if drop_last:
            raise ValueError("drop_last=True cannot be used with policy='dynamic' "
                             "(every row of the epoch must be delivered)")
        if services is None:
            raise ValueError(
                "policy='dynamic' needs a lease service in ctx.services (set by the "
                "coordinator; outside one use InputContext(services=LocalLeaseService()))")
        self.source = source
        self.services = services
        self.pipeline = pipeline
        # this loader's consumption, across its epochs
        self.rate = ConsumptionRate(config.seconds("data.pace-span"))
        self.lead = config.seconds("data.lease-lead")
        self.lease_seconds = config.seconds("data.lease-seconds")

    def split(self, pipeline: tuple[int, int], before: Callable[[], None] = lambda: None
              ) -> None:
        """Nothing to split: workers share the epoch's rows through leases."""

    def num_rows(self) -> int:
        """Every row of the epoch (``TypeError`` while lengths are unknown)."""
        rows = self.source.unit_rows()
        if rows is None:
            raise TypeError(f"the {self.source.what} has partitions of unknown length "
                            "(learned as they are computed, never by a pass first)")
        return sum(rows)

    def length(self, batch_size: int, drop_last: bool) -> int:
        raise TypeError("a dynamic loader has no fixed length (workers share units)")

    def open(self, reader: SourceReader, epoch: int, position: int,
             define: Callable[[], None], outside: bool) -> ChunkSource:
        """A pass over rows leased now (``define``: the loader's dataset definition,
        once; ``outside``: no coordinator runs the closures that take its batches)."""
        return LeasedPass(reader.spec, epoch, lambda drop: reader.unit_reads(epoch, drop),
                          define, outside, self.rate, self.lead, self.lease_seconds)

    def position(self, consumed: int) -> int:
        return 0  # the lease table holds the epoch's ledger

    def check_pipeline(self, state: dict) -> None:
        """Any pipeline may resume a dynamic epoch."""

    def progress(self, define: Callable[[], None], dataset_id: str, epoch: int,
                 position: int) -> dict:
        """The lease table's counts for the epoch (``total``, ``acknowledged``,
        ``leased``, ``free``, ``complete``, ``failed``)."""
        define()
        return self.services.progress(dataset_id, epoch)


def make_plan(source: Source, policy: str, services: Any, drop_last: bool,
              pipeline: tuple[int, int]) -> StaticPlan | LeasedPlan:
    """The plan of ``policy``, one of ``POLICIES`` (:mod:`.options` checked it)."""
    if policy == "dynamic":
        return LeasedPlan(source, services, drop_last, pipeline)
    return StaticPlan(source, policy, pipeline)
