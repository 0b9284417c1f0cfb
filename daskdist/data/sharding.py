"""Static sharding policies (pure): which rows of which units one input pipeline reads.

TensorFlow's auto-sharding semantics (``tf.data.experimental.AutoShardPolicy``):

- ``"file"``: whole files round-robin over pipelines (file ``f`` goes to pipeline
  ``f % n``); fewer files than pipelines is an error naming both counts.
- ``"row_group"``: whole units (row groups) round-robin over pipelines.
- ``"data"``: every pipeline reads everything and keeps its share, the rows whose
  global id ``g`` satisfies ``g % n == pipeline``.
- ``"auto"``: ``"file"`` when there are at least as many files as pipelines, else
  ``"row_group"`` when there are enough units, else ``"data"``.
- ``"off"``: every pipeline reads every row.

``"dynamic"`` is not a static plan: units are leased on demand (see
``daskdist.core.leases.table``). This module only sees groups and row counts, so it decides
for files and a Dask collection's partitions alike (a partition is its own group; its
row count may be unknown until it is computed: its rows are then kept by their position
in it) and is unit-tested without files; each policy partitions the rows exactly across
pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["POLICIES", "Piece", "assign", "rows_selected"]

POLICIES = ("auto", "file", "row_group", "data", "off", "dynamic")


@dataclass(frozen=True)
class Piece:
    """Rows of one unit read by a pipeline: local rows ``r`` with
    ``(start + r) % stride == offset`` (``stride=1``: the whole unit). ``num_rows`` is
    ``None`` for a unit whose length is not known yet (``start`` is 0 then)."""

    unit: int
    start: int  # global id of the unit's first row
    num_rows: int | None  # rows in the unit
    stride: int = 1
    offset: int = 0

    @property
    def rows(self) -> int | None:
        """How many rows of the unit this piece keeps (``None``: not known yet)."""
        if self.num_rows is None:
            return None
        return rows_selected(self.start, self.num_rows, self.stride, self.offset)

    def first_local(self) -> int:
        """Local index of the first kept row."""
        return (self.offset - self.start) % self.stride


def rows_selected(start: int, num_rows: int, stride: int, offset: int) -> int:
    """Count of ``r`` in ``[0, num_rows)`` with ``(start + r) % stride == offset``."""
    first = (offset - start) % stride
    return max(0, -(-(num_rows - first) // stride))


def assign(
    file_of_unit: Sequence[int],
    rows_of_unit: Sequence[int] | None,
    num_pipelines: int,
    pipeline_id: int,
    policy: str = "auto",
) -> tuple[str, list[Piece]]:
    """The resolved policy and the pieces (in stable unit order) pipeline ``pipeline_id``
    of ``num_pipelines`` reads (``rows_of_unit`` ``None``: the units' lengths are not
    known). ``ValueError`` for an unknown policy, or for ``"file"`` with fewer files than
    pipelines."""
    if policy not in POLICIES or policy == "dynamic":
        raise ValueError(f"unknown static sharding policy {policy!r}; one of {POLICIES}")
    if rows_of_unit is not None and len(file_of_unit) != len(rows_of_unit):
        raise ValueError("file_of_unit and rows_of_unit differ in length")
    n, i = num_pipelines, pipeline_id
    rows: list[int | None] = (list(rows_of_unit) if rows_of_unit is not None
                              else [None] * len(file_of_unit))
    starts, pos = [], 0
    for r in rows:
        starts.append(pos)
        pos += r or 0
    num_files = len(set(file_of_unit))
    num_units = len(rows)
    if policy == "auto":
        if n == 1:
            policy = "off"
        elif num_files >= n:
            policy = "file"
        elif num_units >= n:
            policy = "row_group"
        else:
            policy = "data"
    if policy == "file" and num_files < n:
        raise ValueError(
            f"sharding policy 'file' needs at least as many files as input pipelines: "
            f"{num_files} files for {n} pipelines (use policy='data' or 'auto')"
        )
    units = range(num_units)
    if policy == "file":
        files = sorted(set(file_of_unit))
        mine = {f for k, f in enumerate(files) if k % n == i}
        units = [u for u in units if file_of_unit[u] in mine]
    elif policy == "row_group":
        units = [u for u in units if u % n == i]
    stride, offset = (n, i) if policy == "data" else (1, 0)
    pieces = [Piece(u, starts[u], rows[u], stride, offset) for u in units]
    return policy, [p for p in pieces if p.rows is None or p.rows > 0]
