"""Durable sharded commits: every rank writes its own shard with DCP, in parallel, and a
group of any size reads its rows back resharded (SPEC §4.3, §4.5).

A checkpoint is a directory ``commit-<n>`` (as a replicated State's, see
``collective/state/checkpoint.py``) holding one DCP checkpoint per rank in ``rank-<r>/``: the
rank's rows of every split tensor as a chunk of the whole tensor (its offsets and the
whole shape in DCP's metadata), written by single-process DCP in the rank's own
background thread (no collective call competes with training). Rank 0's part also
holds the rest (buffers, counters, hyperparameters, the State's objects, which tensors
are split and how) and the ledger of the State's ``"dynamic"`` datasets at that commit.
Rank 0 waits until every rank's part is complete, then writes the checkpoint's own DCP
``.metadata`` (every part's chunks, paths into the parts) last, by rename: a
checkpoint without it was cut off and is never loaded; with it, plain ``dcp.load``
reads it too. Reading plans each rank's rows of the new cut against every chunk
(DCP's resharding), so the writers' world size does not matter.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_item_for_byteio,
    create_read_items_for_chunk_list,
)

from daskdist import config
from daskdist.collective.bootstrap import PROCESS
from daskdist.collective.state.checkpoint import (
    METADATA,
    CheckpointInfo,
    Durable,
    Written,
    report_written,
)

logger = logging.getLogger(__name__)

_REST = "daskdist"  # rank 0's bytes entry: the rest and the record
_PAUSE = (0.02, 0.5)  # first and longest pause between looks for the parts


def part_name(rank: int) -> str:
    return f"rank-{rank:05d}"


Chunk = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]  # (rows, offsets, whole shape)


class ShardedDurable(Durable):
    """``ShardedState.checkpoint_to(url, every)``: which commits are written (every
    ``every``-th), each rank's part of them, rank 0's completion, and reading a
    checkpoint's rows for any cut (see the module)."""

    def write_part(self, state_id: str, commits: int, rank: int, world: int,
                   generation: int, chunks: dict[str, Chunk], rest: Any, services: Any,
                   wait: bool = False) -> Future | None:
        """Write this rank's ``chunks`` of commit ``commits`` (rank 0: with ``rest`` and
        the datasets' ledger, then the checkpoint's metadata once every part is written)
        in the background. A write of this rank still running is waited for first, so
        every rank writes the same commits. ``wait``: until written (a leaving last
        holder)."""
        store = self.store
        if store.writing:
            logger.info("daskdist: the checkpoint before commit %d is still being written; "
                        "waiting for it", commits)
        try:
            store.wait()
        except Exception as e:  # noqa: BLE001 - reported by its own callback
            logger.debug("daskdist: the previous checkpoint write failed: %r", e)
        if wait and self.newest() >= commits:
            return None
        blob = None
        if rank == 0:
            ledger = services.dataset_ledger(state_id) if services is not None else {}
            blob = {"rest": rest, "record": {"state": state_id, "ledger": ledger,
                                             "commits": commits, "world": world,
                                             "time": time.time()}}
        fut = store.submit(self._write, int(commits), rank, world, generation, chunks, blob)
        if fut is None:  # another thread started one meanwhile: none does
            return None
        if services is not None and rank == 0:
            fut.add_done_callback(lambda f: report_written(services, state_id, f))
        if wait:
            fut.result()
        return fut

    def _write(self, commits: int, rank: int, world: int, generation: int,
               chunks: dict[str, Chunk], blob: dict | None) -> Written | None:
        t0 = time.perf_counter()
        store = self.store
        root = store.dir_of(commits)
        _remove(store.fs, f"{root}/{METADATA}")  # an older run's: never over new parts
        part = f"{root}/{part_name(rank)}"
        if store.fs.exists(part):
            store.fs.rm(part, recursive=True)
        dcp.save({}, storage_writer=store.writer(store.url_of(part)),
                 planner=_PartSaver(chunks, blob), no_dist=True)
        if rank != 0:
            return None
        if not self._parts_written(root, world, generation):
            logger.warning("daskdist: checkpoint of commit %d abandoned: not every rank of "
                           "generation %d wrote its part", commits, generation)
            return None
        _write_metadata(store, root, world)
        nbytes = sum(store.fs.size(p) for p in store.fs.find(root))
        store.prune()
        return Written(CheckpointInfo(store.url_of(root), commits),
                       time.perf_counter() - t0, nbytes)

    def _parts_written(self, root: str, world: int, generation: int) -> bool:
        """Rank 0's background thread: wait until every rank's part has its metadata.
        Ends when all have; ``False`` once the writing generation lost a member with a
        part still missing, or after ``daskdist.collective.checkpoint-timeout``."""
        fs = self.store.fs
        deadline = time.monotonic() + config.seconds("collective.checkpoint-timeout")
        pause = _PAUSE[0]
        missing = list(range(world))
        while True:
            missing = [r for r in missing
                       if not fs.exists(f"{root}/{part_name(r)}/{METADATA}")]
            if not missing:
                return True
            if PROCESS.is_lost(generation) or time.monotonic() > deadline:
                return False
            time.sleep(pause)  # a store to poll: no event tells of another host's write
            pause = min(pause * 2, _PAUSE[1])

    # -- reading --------------------------------------------------------------------------
    def _url(self, commits: int) -> str:
        return self.store.url_of(self.store.dir_of(commits))

    def read_rest(self, commits: int) -> dict:
        """Checkpoint ``commits``'s rest and record (``{"rest": ..., "record": ...}``)."""
        planner = _PartLoader({}, rest=True)
        dcp.load({}, storage_reader=self.store.reader(self._url(commits)), planner=planner,
                 no_dist=True)
        return planner.rest

    def read_rows(self, commits: int, targets: dict[str, tuple[torch.Tensor, tuple]]) -> None:
        """Read checkpoint ``commits``'s rows into ``targets`` (key -> (this rank's
        rows of the whole tensor, their offsets in it)), whatever world wrote them."""
        targets = {k: v for k, v in targets.items() if v[0].numel()}
        dcp.load({}, storage_reader=self.store.reader(self._url(commits)),
                 planner=_PartLoader(targets), no_dist=True)


class _PartSaver(DefaultSavePlanner):
    """DCP's planner for one rank's part: its chunks of whole tensors, and rank 0's rest
    (no check that the chunks cover the tensors: the other parts hold the rest)."""

    def __init__(self, chunks: dict[str, Chunk], rest: Any) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         dedup_save_to_lowest_rank=False)
        self.chunks = {k: v for k, v in chunks.items() if v[0].numel()}
        self.rest = rest

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, (t, offs, shape) in self.chunks.items():
            items.append(WriteItem(
                index=MetadataIndex(key, offs), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offs), sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=torch.Size(shape))))
        if self.rest is not None:
            items.append(WriteItem(index=MetadataIndex(_REST), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(all_plans)
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.rest if index.fqn == _REST else self.chunks[index.fqn][0]


class _PartLoader(DefaultLoadPlanner):
    """DCP's planner for this rank's rows of a checkpoint (and, asked, the rest)."""

    def __init__(self, targets: dict[str, tuple[torch.Tensor, tuple]], rest: bool = False):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.targets = targets
        self.want_rest = rest
        self.rest: Any = None

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items = []
        for key, (t, offs) in self.targets.items():
            meta = md.get(key)
            if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != \
                    tuple(_whole(t, offs, meta)):
                raise ValueError(f"ShardedState: the checkpoint holds no tensor {key!r} of "
                                 f"this model's shape (is it this model's checkpoint?)")
            items += create_read_items_for_chunk_list(
                key, meta, [ChunkStorageMetadata(torch.Size(offs), t.size())])
        if self.want_rest:
            if _REST not in md:
                raise ValueError("ShardedState: the checkpoint holds no daskdist record")
            items.append(_create_read_item_for_byteio(
                dest_index=MetadataIndex(_REST), dest_offset=0,
                storage_index=MetadataIndex(_REST), storage_offset=0, length=0))
        self.plan = LoadPlan(items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[index.fqn][0]

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.rest = torch.load(value, map_location="cpu", weights_only=False)


def _whole(t: torch.Tensor, offs: tuple, meta: TensorStorageMetadata) -> tuple:
    """The whole shape a target's rows belong to (the checkpoint's, when they fit it)."""
    size = tuple(meta.size)
    fits = len(size) == t.dim() and all(o + n <= s for o, n, s in zip(offs, t.shape, size,
                                                                     strict=True))
    return size if fits else tuple(-1 for _ in size)


def _write_metadata(store: Any, root: str, world: int) -> None:
    """The checkpoint's DCP metadata from its parts' (written last, by rename)."""
    fs = store.fs
    merged: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    version = None
    for r in range(world):
        part = f"{root}/{part_name(r)}"
        with fs.open(f"{part}/{METADATA}", "rb") as f:
            md = pickle.load(f)
        version = getattr(md, "version", version)
        for fqn, m in md.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                have = merged.setdefault(fqn, TensorStorageMetadata(m.properties, m.size, []))
                have.chunks.extend(m.chunks)
            else:
                merged[fqn] = m
        for index, info in md.storage_data.items():
            storage[index] = dataclasses.replace(
                info, relative_path=f"{part_name(r)}/{info.relative_path}")
    md = Metadata(state_dict_metadata=merged, storage_data=storage)
    if version is not None:
        md.version = version
    tmp = f"{root}/{METADATA}.tmp"
    with fs.open(tmp, "wb") as f:
        pickle.dump(md, f)
    fs.mv(tmp, f"{root}/{METADATA}")


def _remove(fs: Any, path: str) -> None:
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
