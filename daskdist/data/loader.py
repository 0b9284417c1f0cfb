"""ArrowLoader: batches of ``dict[str, torch.Tensor]`` from Arrow shards, per input pipeline.

What happens, in the producer (a background thread unless ``prefetch=0``):

1. the pipeline's pieces come from a sharding policy (:mod:`.sharding`), or, under
   ``policy="dynamic"``, units are leased one at a time from ``ctx.leases``;
2. the epoch plan (:mod:`.batching`) groups pieces into blocks (shuffled: piece order
   permuted by ``(seed, epoch)``, each block's rows permuted by one gather);
3. each block is read with pyarrow and converted column-wise to tensors (:mod:`.convert`;
   shuffled blocks are gathered, two blocks at once in builder threads), then cut into
   ``batch_size`` views; only a batch straddling two blocks is copied.

The consumer's ``__next__`` hands out ready batches (a bounded queue of ``prefetch``
batches, so memory is bounded by prefetch and the shuffle buffer, never the dataset),
moves them to the device (pinned + ``non_blocking`` for CUDA) and, under the dynamic
policy, records the batch's rows with :func:`daskdist.context.record_consumed` in the
consumer's (closure's) thread. State for resuming is ``(epoch, seed, position)``.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import torch

from daskdist.context import InputContext, record_consumed
from daskdist.data import batching
from daskdist.data.convert import (
    concat_cols,
    convert_chunk,
    num_rows,
    pin,
    slice_cols,
    to_device,
)
from daskdist.data.dynamic import lease_token
from daskdist.data.sharding import POLICIES, assign
from daskdist.data.shards import ArrowShards, UnitReader
from daskdist.intervals import normalize, subtract, union

__all__ = ["ArrowLoader"]

_END = object()
_BUILDERS = 2  # shuffled blocks read, gathered and converted at once


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _ChunkBuffer:
    """Bounded hand-off of converted chunks from the prefetch thread to the consumer.

    The producer waits while the queued chunks hold ``max_rows`` rows or more (``prefetch``
    batches), so memory is bounded by that plus the chunks being built (one block, or
    ``_BUILDERS`` shuffle blocks).
    """

    def __init__(self, max_rows: int) -> None:
        self._cv = threading.Condition()
        self._items: deque[tuple[Any, int]] = deque()
        self._rows = 0
        self._max_rows = max(1, max_rows)
        self._closed = False

    def put(self, item: Any, rows: int) -> bool:
        with self._cv:
            while self._rows >= self._max_rows and not self._closed:
                self._cv.wait()
            if self._closed:
                return False
            self._items.append((item, rows))
            self._rows += rows
            self._cv.notify_all()
            return True

    def get(self) -> Any:
        with self._cv:
            while not self._items:
                self._cv.wait()
            item, rows = self._items.popleft()
            self._rows -= rows
            self._cv.notify_all()
            return item

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._items.clear()
            self._rows = 0
            self._cv.notify_all()


def _produce(gen: Iterator[tuple], buf: _ChunkBuffer) -> None:
    """Prefetch thread body: push every chunk of ``gen``, then ``_END`` (or a failure)."""
    try:
        for item in gen:
            if not buf.put(item, item[2]):
                return
        buf.put(_END, 0)
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
        buf.put(_Failure(e), 0)
    finally:
        gen.close()


class ArrowLoader:
    """An iterable of batches (``dict[str, torch.Tensor]``) for one input pipeline.

    See SPEC §3. ``ctx`` is the pipeline's :class:`~daskdist.context.InputContext`
    (default: a single pipeline). ``shuffle_buffer`` is the minimum rows per shuffled
    block. ``name`` makes :attr:`dataset_id` (the lease-table key under
    ``policy="dynamic"``) distinct for two loaders over the same files.
    """

    def __init__(
        self,
        shards: ArrowShards | str | os.PathLike | Sequence[str] | pads.Dataset,
        ctx: InputContext | None = None,
        batch_size: int = 256,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        columns: Sequence[str] | None = None,
        policy: str = "auto",
        prefetch: int = 2,
        fill_null: Any = None,
        collate: Callable[[pa.Table], Any] | None = None,
        device: Any = None,
        shuffle_buffer: int = 65536,
        name: str | None = None,
    ) -> None:
        if not isinstance(shards, ArrowShards):
            shards = ArrowShards(shards)
        self.shards = shards
        self.ctx = ctx if ctx is not None else InputContext()
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(prefetch) < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if policy not in POLICIES:
            raise ValueError(f"unknown sharding policy {policy!r}; one of {POLICIES}")
        if policy == "dynamic":
            if drop_last:
                raise ValueError("drop_last=True cannot be used with policy='dynamic' "
                                 "(every row of the epoch must be delivered)")
            if self.ctx.leases is None:
                raise ValueError(
                    "policy='dynamic' needs a lease service in ctx.leases (set by the "
                    "coordinator; outside one use InputContext(leases=LocalLeaseService()))"
                )
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.prefetch = int(prefetch)
        self.fill_null = fill_null
        self.collate = collate
        self.shuffle_buffer = int(shuffle_buffer)
        self.device = torch.device(device) if device is not None else self.ctx.device

        units = shards.units  # reads footers: a bad file raises here, before any batch
        names = shards.schema.names
        self.columns = list(columns) if columns is not None else list(names)
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise ValueError(f"column(s) {missing} not in the shards' schema {names}")
        self.dataset_id = shards.dataset_id(name)
        self._unit_rows = [u.num_rows for u in units]
        if policy == "dynamic":
            self.policy, self._pieces = "dynamic", []
        else:
            self.policy, self._pieces = assign(
                [u.file_index for u in units], self._unit_rows,
                self.ctx.num_input_pipelines, self.ctx.input_pipeline_id, policy,
            )
        self.epoch = 0
        self._resume: int | None = None
        self._active: _LoaderIterator | None = None

    # -- public API ----------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows this pipeline reads per epoch (all rows under ``"dynamic"``)."""
        if self.policy == "dynamic":
            return sum(self._unit_rows)
        return sum(p.rows for p in self._pieces)

    def __len__(self) -> int:
        if self.policy == "dynamic":
            raise TypeError("a dynamic loader has no fixed length (workers share units)")
        n = self.num_rows
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (shuffle order, lease table); a change restarts iteration."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.close()
            self._active = None
            self.epoch = epoch
            self._resume = None

    def __iter__(self) -> _LoaderIterator:
        self.close()
        start = self._resume if self._resume is not None else 0
        self._resume = None
        self._active = _LoaderIterator(self, start)
        return self._active

    def close(self) -> None:
        """Stop the active iterator's prefetch thread (leased, undelivered rows are
        given back when the lease service supports ``release``)."""
        if self._active is not None:
            self._active.close()

    def state_dict(self) -> dict:
        """Small resumable state: epoch, seed and rows consumed so far this epoch."""
        if self._active is not None:
            pos = self._active.position
        else:
            pos = self._resume or 0
        return {
            "dataset_id": self.dataset_id,
            "policy": self.policy,
            "pipeline": [self.ctx.input_pipeline_id, self.ctx.num_input_pipelines],
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "position": 0 if self.policy == "dynamic" else int(pos),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``iter()`` continues after the last row consumed."""
        if state.get("dataset_id") != self.dataset_id:
            raise ValueError(
                f"state is for dataset {state.get('dataset_id')!r}, this loader reads "
                f"{self.dataset_id!r}"
            )
        mine = [self.ctx.input_pipeline_id, self.ctx.num_input_pipelines]
        if self.policy != "dynamic" and list(state.get("pipeline", mine)) != mine:
            raise ValueError(f"state is for pipeline {state['pipeline']}, this is {mine}")
        self.close()
        self._active = None
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.shuffle_buffer = int(state.get("shuffle_buffer", self.shuffle_buffer))
        self._resume = int(state.get("position", 0)) or None

    def progress(self) -> dict:
        """Under ``"dynamic"``: the lease table's counts for this epoch (``total``,
        ``acknowledged``, ``leased``, ``free``, ``complete``). Otherwise this pipeline's
        own rows consumed against its total."""
        if self.policy == "dynamic":
            return self.ctx.leases.progress(self.dataset_id, self.epoch, self._unit_rows)
        total = self.num_rows
        pos = self.state_dict()["position"]
        return {"total": total, "consumed": pos, "complete": pos >= total}

    def __repr__(self) -> str:
        return (f"ArrowLoader({self.shards!r}, batch_size={self.batch_size}, "
                f"policy={self.policy!r}, pipeline={self.ctx.input_pipeline_id}/"
                f"{self.ctx.num_input_pipelines}, epoch={self.epoch})")

    # -- producer side (runs in the prefetch thread) --------------------------------------
    def _convert(self, table: pa.Table, index: np.ndarray | None) -> Any:
        """Rows ``index`` of ``table``: a table for ``collate``, else a :class:`Chunk`.

        Gathers release the GIL (one Arrow ``take``; ``index_select`` per column into
        2-D buffers), so they overlap with the consumer cutting batches.
        """
        if self.collate is not None:
            return table if index is None else table.take(pa.array(index))
        return convert_chunk(table, self.fill_null, index)

    def _block(self, blocks: list[batching.Block], bi: int, skip: int, epoch: int,
               reader: UnitReader) -> Any:
        """Block ``bi`` read, gathered (strided pieces, shuffle) and converted, from its
        row ``skip`` on."""
        blk = blocks[bi]
        units = self.shards.units
        tables = [reader.read(units[self._pieces[k].unit], self.columns) for k in blk.pieces]
        idx, strided, base = [], False, 0
        for k in blk.pieces:
            p = self._pieces[k]
            if p.stride != 1:
                strided = True
            idx.append(np.arange(p.first_local(), p.num_rows, p.stride) + base)
            base += p.num_rows
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        index = np.concatenate(idx) if strided else None
        if blk.shuffled:
            perm = batching.block_permutation(blk.rows, self.seed, epoch, bi)
            index = perm if index is None else index[perm]
        if skip:
            if index is None:
                table = table.slice(skip)
            else:
                index = index[skip:]
        return self._convert(table, index)

    def _static_chunks(self, epoch: int, position: int) -> Iterator[tuple[Any, None]]:
        blocks = batching.plan_blocks(
            [p.rows for p in self._pieces], self.shuffle, self.seed, epoch, self.shuffle_buffer
        )
        b, off = batching.locate(blocks, position)
        if not self.shuffle:  # reading is the work, and pyarrow spreads it over threads
            reader = self.shards.reader()
            try:
                for bi in range(b, len(blocks)):
                    yield self._block(blocks, bi, off if bi == b else 0, epoch, reader), None
            finally:
                reader.close()
            return
        # Shuffled: gathers are single-threaded, so _BUILDERS blocks are built at once,
        # each in a thread with a reader of its own, and handed on in order.
        local = threading.local()
        readers: list[UnitReader] = []

        def build(bi: int) -> Any:
            reader = getattr(local, "reader", None)
            if reader is None:
                reader = local.reader = self.shards.reader()
                readers.append(reader)
            return self._block(blocks, bi, off if bi == b else 0, epoch, reader)

        pool = ThreadPoolExecutor(_BUILDERS, "daskdist-block")
        futs: deque = deque()
        try:
            for bi in range(b, len(blocks)):
                futs.append(pool.submit(build, bi))
                if len(futs) >= _BUILDERS:
                    yield futs.popleft().result(), None
            while futs:
                yield futs.popleft().result(), None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for r in readers:
                r.close()

    def _dynamic_chunks(self, epoch: int, book: _LeaseBook) -> Iterator[tuple[Any, np.ndarray]]:
        svc = self.ctx.leases
        units = self.shards.units
        reader = self.shards.reader()
        try:
            while True:
                lease = svc.acquire(self.dataset_id, epoch, self._unit_rows)
                if lease is None:
                    return
                u, intervals = lease
                book.add(intervals)
                unit = units[u]
                ids = batching.ids_of_ranges(intervals)
                if len(ids) == 0:
                    continue
                table = reader.read(unit, self.columns)
                local = ids - unit.start
                if self.shuffle:
                    tile = batching.dynamic_tile(self.batch_size)
                    order = batching.dynamic_order(len(ids), self.seed, epoch, u, tile)
                    ids, index = ids[order], local[order]
                else:
                    index = None if len(ids) == unit.num_rows else local
                yield self._convert(table, index), ids
        finally:
            reader.close()

    def _chunks(self, chunks: Iterator[tuple[Any, np.ndarray | None]]) -> Iterator[tuple]:
        """``(columns, ids | None, rows)`` per chunk, pinned for CUDA devices."""
        for cols, ids in chunks:
            n = num_rows(cols)
            if n == 0:
                continue
            if self.device.type == "cuda" and self.collate is None:
                cols = pin(cols)
            yield cols, ids, n


class _LeaseBook:
    """Rows leased by one iterator and not yet handed to a closure (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outstanding: list[tuple[int, int]] = []

    def add(self, ranges: list[tuple[int, int]]) -> None:
        with self._lock:
            self.outstanding = union(self.outstanding, normalize(ranges))

    def delivered(self, ranges: list[tuple[int, int]]) -> None:
        with self._lock:
            self.outstanding = subtract(self.outstanding, ranges)


class _LoaderIterator:
    """One pass over a loader's epoch; under ``"dynamic"``, ``next()`` may be called
    again after ``StopIteration`` to pick up rows that came back to the pool.

    The prefetch thread converts whole chunks (the GIL-free part: reading, decoding,
    gathering); ``__next__`` cuts ``batch_size`` views from the current chunk, so slicing
    overlaps with the next chunk's decoding. Only a batch straddling chunks is copied.
    """

    def __init__(self, loader: ArrowLoader, position: int) -> None:
        self.loader = loader
        self.epoch = loader.epoch
        self.position = position
        self._bs = loader.batch_size
        self._dynamic = loader.policy == "dynamic"
        self._book = _LeaseBook() if self._dynamic else None
        self._device = loader.device if loader.device.type != "cpu" else None
        self._cur: list | None = None  # [columns, ids, rows, next row]
        self._thread: threading.Thread | None = None
        self._buf: _ChunkBuffer | None = None
        self._gen: Iterator[tuple] | None = None
        self._done = False
        self._closed = False
        self._start()

    def _start(self) -> None:
        ld = self.loader
        self._done = False
        if self._dynamic:
            gen = ld._chunks(ld._dynamic_chunks(self.epoch, self._book))
        else:
            gen = ld._chunks(ld._static_chunks(self.epoch, self.position))
        if ld.prefetch == 0:
            self._gen = gen
            return
        self._buf = _ChunkBuffer(ld.prefetch * ld.batch_size)
        self._thread = threading.Thread(
            target=_produce, args=(gen, self._buf), daemon=True,
            name=f"daskdist-prefetch-{ld.dataset_id}",
        )
        self._thread.start()

    def __iter__(self) -> _LoaderIterator:
        return self

    def _next_chunk(self) -> tuple | None:
        if self._done:
            return None
        item = next(self._gen, _END) if self._gen is not None else self._buf.get()
        if item is _END or isinstance(item, _Failure):
            self._done = True
            self._join()
            if item is not _END:
                raise item.exc
            return None
        return item

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        bs = self._bs
        cur = self._cur
        if cur is not None and cur[3] + bs <= cur[2]:  # fast path: a view of the chunk
            a = cur[3]
            cur[3] = a + bs
            cols = slice_cols(cur[0], a, a + bs)
            ids = cur[1][a:a + bs] if cur[1] is not None else None
        else:
            cols, ids = self._gather()
        n = num_rows(cols)
        self.position += n
        if ids is not None:
            ranges = batching.ranges_of_ids(ids)
            self._book.delivered(ranges)
            record_consumed(lease_token(self.loader.dataset_id, self.epoch, ranges))
        if self.loader.collate is not None:
            cols = self.loader.collate(cols)
        if self._device is not None:
            cols = to_device(cols, self._device)
        return cols

    def _gather(self) -> tuple[Any, np.ndarray | None]:
        """A batch from the rest of the current chunk and the next ones (copies)."""
        bs = self._bs
        parts: list[Any] = []
        id_parts: list[np.ndarray] = []
        got = 0
        if self._done and self._dynamic and self._cur is None:
            self._start()  # rows may have come back to the pool since
        while got < bs:
            cur = self._cur
            if cur is None or cur[3] >= cur[2]:
                self._cur = None
                chunk = self._next_chunk()
                if chunk is None:
                    break
                cur = self._cur = [chunk[0], chunk[1], chunk[2], 0]
            a = cur[3]
            b = min(cur[2], a + bs - got)
            parts.append(slice_cols(cur[0], a, b))
            if cur[1] is not None:
                id_parts.append(cur[1][a:b])
            cur[3] = b
            got += b - a
        if got == 0 or (got < bs and self.loader.drop_last):
            raise StopIteration
        ids = None
        if id_parts:
            ids = id_parts[0] if len(id_parts) == 1 else np.concatenate(id_parts)
        cols = concat_cols(parts)
        if self.loader.device.type == "cuda" and self.loader.collate is None and len(parts) > 1:
            cols = pin(cols)
        return cols, ids

    def _join(self) -> None:
        if self._gen is not None:
            self._gen.close()
            self._gen = None
        if self._thread is not None:
            self._buf.close()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop prefetching; give back leased rows that were never handed out."""
        if self._closed:
            return
        self._closed = True
        self._cur = None
        self._join()
        if self._book is not None and self._book.outstanding:
            release = getattr(self.loader.ctx.leases, "release", None)
            if release is not None:
                release(self.loader.dataset_id, self.epoch, list(self._book.outstanding))
            self._book.outstanding = []

    def __del__(self) -> None:
        # Only signal the prefetch thread: no join and no lease RPC here, since the
        # collector may run on an event loop the thread (or the RPC) is waiting for.
        # Rows still leased return to the pool when the worker's session ends.
        try:
            if self._buf is not None:
                self._buf.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
