"""ArrowLoader: batches of ``dict[str, torch.Tensor]`` from Arrow shards, per input pipeline.

The pipeline, in stages with one job each:

1. a *pass* over the epoch yields converted blocks: the loader's plan (:mod:`.plans`)
   opens it on its source's reader (:mod:`.sources`: files, a Dask collection, ...):
   a static policy's pieces (:mod:`.sharding`) from a stream position, or rows leased
   from ``ctx.services`` (``"dynamic"``, :mod:`.leased`);
2. for a CUDA device, the *device stage* (:mod:`.staging`) copies each whole block to
   the device through a ring of reused pinned buffers, one copy per dtype, in a staging
   thread: the block goes on at once, pending, and is resolved when it is taken;
3. a *feed* (:mod:`.prefetch`) runs 1-2 in a prefetch thread and hands blocks over
   through a buffer bounded by ``prefetch`` batches (or inline with ``prefetch=0``);
4. the *iterator* only cuts ``batch_size`` views from the current block (a batch
   straddling two blocks is concatenated) and tells the source which rows it handed
   out (under ``"dynamic"`` the source records them for the caller's closure);
5. the batch is finished after the cut: the caller's CUDA stream waits for the block's
   copy, ``collate`` runs on the host, other devices get a plain ``.to(device)``.

**Threads** (SPEC §2.6). TensorFlow runs a worker's closures on one thread; a Dask
worker has several, and closures sharing one per-worker iterator call ``next()`` at
once. The rule: ``next()`` on a :class:`_LoaderIterator` is safe from any number of
threads. Serialized (the iterator's lock): cutting a batch, taking the next block, and
marking the batch's rows delivered (and recording them for the caller's closure, in
the caller's thread), so each batch goes to exactly one caller. Not serialized (after
the lock, in the caller's thread): the device step, ``collate``. Ownership: the prefetch
thread owns the pass's generator and its reads; the staging thread owns the staging
ring; callers own only the batches they got.

Every wait ends. A caller waits for the lock (ends when the holder finishes its cut,
whose own waits end as follows) or for the next block (ends on a block, the end of the
pass, a failure, or ``close()``), then, for CUDA, for that block's staging (ends when the
staging thread has copied it, or at once once a close dropped it); the producer waits
for room in the buffer (ends when a caller takes a block, or ``close()``), for a lease
RPC (ends with its reply, or ``daskdist.worker.rpc-timeout``), or for a Dask
collection's partition (ends when Dask has it, or ``close()``: the pass's
``interrupt``). Shutdown, ``close()`` from any thread: mark closed, interrupt the pass,
end the feed's waits (callers waiting for a block get ``StopIteration``), join the
prefetch thread without holding the lock (it returns once its current read or lease
RPC does), take the lock, give back rows leased and not delivered. A caller arriving
after the end of the pass gets ``StopIteration``; under ``"dynamic"`` it first polls the
lease service again (a new pass), so rows that came back to the pool are still served,
with any number of threads. A pass that fails raises its error to the caller it
reaches, and what it still holds (that caller's unfinished batch) goes back to the pool
then. The loader's ``close()`` also releases its source reader's resources (a
collection's local partition pool).

Memory is bounded by ``prefetch`` batches, the shuffle buffer and the staging ring,
never the dataset. State for resuming is ``(epoch, seed, position)``.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import torch

from daskdist import config
from daskdist.context import InputContext
from daskdist.core.intervals import normalize
from daskdist.data import batching
from daskdist.data.convert import concat_cols, slice_cols, to_device
from daskdist.data.files.arrow import ArrowShards
from daskdist.data.options import CHECKS, check_options, unknown_fill_columns
from daskdist.data.plans import make_plan
from daskdist.data.prefetch import CLOSED, END, Failure, Feed
from daskdist.data.sources import ChunkItem, ChunkSource, ReadSpec, as_source
from daskdist.data.staging import CudaTransfer, DeviceStage
from daskdist.errors import InputError
from daskdist.observe import phases

__all__ = ["ArrowLoader"]


def _torch_device(device: Any) -> torch.device:
    """The ``device`` option (checked in form by :mod:`.options`) as torch reads it."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device must name a torch device, got {device!r}: {e}") from None


def _check_device(device: torch.device, ctx: InputContext) -> None:
    """A CUDA device this process cannot use is bad input: ``InputError`` naming both."""
    if device.type != "cuda":
        return
    where = (f"worker {ctx.worker.address}" if ctx.worker is not None
             else f"this process (pid {os.getpid()})")
    if not torch.cuda.is_available():
        raise InputError(f"ArrowLoader: device {str(device)!r} requested on {where}, "
                         "which has no CUDA (torch.cuda.is_available() is False)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise InputError(f"ArrowLoader: device {str(device)!r} requested on {where}, "
                         f"which has {torch.cuda.device_count()} CUDA device(s)")


class ArrowLoader:
    """An iterable of batches (``dict[str, torch.Tensor]``) for one input pipeline.

    See SPEC §3. ``ctx`` is the pipeline's :class:`~daskdist.context.InputContext`
    (default: a single pipeline). ``shuffle_buffer`` is the minimum rows per shuffled
    block. ``name`` is a label (the dashboard's, and a checkpoint ledger's key).

    A loader is a dataset of its own: :attr:`dataset_id` (its key in the dynamic lease
    table) is the per-worker dataset's id when a coordinator's worker builds it (the
    same on every worker; ``"<id>.<k>"`` for the k-th further loader one factory
    builds), else a fresh id. Under ``policy="dynamic"`` a lease covers at least
    ``lease_rows`` rows (default ``daskdist.data.lease-rows``) and 2 batches.

    ``shards`` may also be a dask DataFrame or a dict of dask Arrays chunked alike along
    axis 0 (SPEC §3.2, :mod:`.collections`): its partitions are the units, computed by
    Dask at most ``partitions_ahead`` (default ``daskdist.data.partitions-ahead``) ahead
    of consumption; the default policy is then ``"dynamic"`` when ``ctx`` has a lease
    service. Anything else is a ``TypeError`` naming what was given.

    ``iter(loader)`` closes the previous iterator and returns one that several threads
    may call ``next()`` on at once (see the module doc for the rule and the shutdown).
    """

    def __init__(
        self,
        shards: ArrowShards | str | os.PathLike | Sequence[str] | pads.Dataset | Any,
        ctx: InputContext | None = None,
        batch_size: int = 256,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        columns: Sequence[Any] | None = None,
        policy: str | None = None,
        prefetch: int = 2,
        fill_null: Any = None,
        collate: Callable[[pa.Table], Any] | None = None,
        device: Any = None,
        shuffle_buffer: int = 65536,
        name: str | None = None,
        lease_rows: int | None = None,
        partitions_ahead: int | None = None,
    ) -> None:
        opts = check_options(dict(
            batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
            columns=columns, policy=policy, prefetch=prefetch, fill_null=fill_null,
            collate=collate, device=device, shuffle_buffer=shuffle_buffer, name=name,
            lease_rows=lease_rows, partitions_ahead=partitions_ahead))  # before any read
        if ctx is not None and not isinstance(ctx, InputContext):
            raise TypeError(f"ctx must be an InputContext, got {type(ctx).__name__}")
        self.source = as_source(shards)  # reads footers: a bad file raises here
        self.shards = self.source.shards
        self.ctx = ctx if ctx is not None else InputContext()
        policy = opts["policy"]
        if policy is None:
            policy = ("dynamic" if self.source.leases_by_default
                      and self.ctx.services is not None else "auto")
        self.batch_size: int = opts["batch_size"]
        self.shuffle: bool = opts["shuffle"]
        self.seed: int = opts["seed"]
        self.drop_last: bool = opts["drop_last"]
        self.prefetch: int = opts["prefetch"]
        self.fill_null = opts["fill_null"]
        self.collate = collate
        self.shuffle_buffer: int = opts["shuffle_buffer"]
        self.device = _torch_device(opts["device"]) if device is not None else self.ctx.device
        _check_device(self.device, self.ctx)
        names = self.source.columns
        self.columns = list(opts["columns"]) if columns is not None else list(names)
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise ValueError(f"column(s) {missing} not in the columns of "
                             f"{self.source.what}: {names}")
        unfilled = unknown_fill_columns(self.fill_null, names)
        if unfilled:
            raise ValueError(f"fill_null names column(s) {unfilled} not in the columns of "
                             f"{self.source.what}: {names}")
        self.name = name or ""
        self.dataset_id = (self.ctx.next_dataset_id()
                           or f"{name or 'arrow'}-{uuid.uuid4().hex[:12]}")
        lease_rows = opts["lease_rows"]
        if lease_rows is None:
            lease_rows = CHECKS["lease_rows"](int(config.get("data.lease-rows", 65536)),
                                              "daskdist.data.lease-rows")
        self.lease_rows = max(lease_rows, 2 * self.batch_size)
        ahead = opts["partitions_ahead"]
        if ahead is None:
            ahead = CHECKS["partitions_ahead"](int(config.get("data.partitions-ahead", 2)),
                                               "daskdist.data.partitions-ahead")
        self.partitions_ahead: int = ahead
        self._plan = make_plan(self.source, policy, self.ctx.services, self.drop_last,
                               (self.ctx.input_pipeline_id, self.ctx.num_input_pipelines))
        self._reader = self.source.open(self._spec())
        self._defined = False
        self._define_lock = threading.Lock()
        self._files: str | None = None  # the source's fingerprint, once asked for
        self.epoch = 0
        self._resume: int | None = None
        self._active: _LoaderIterator | None = None

    def _spec(self) -> ReadSpec:
        """What this loader's source reader is given (its reading options)."""
        return ReadSpec(tuple(self.columns), self.batch_size, self.shuffle, self.seed,
                        self.shuffle_buffer, self.fill_null, self.collate is not None,
                        self.partitions_ahead, self.dataset_id, self.name or self.dataset_id,
                        self.lease_rows, self.ctx.services)

    # -- public API ----------------------------------------------------------------------
    @property
    def policy(self) -> str:
        """The policy in force (``"auto"`` resolved for the current split)."""
        return self._plan.policy

    @property
    def num_rows(self) -> int:
        """Rows this pipeline reads per epoch (all rows under ``"dynamic"``); a
        collection whose lengths are not known yet: ``TypeError``."""
        return self._plan.num_rows()

    def __len__(self) -> int:
        return self._plan.length(self.batch_size, self.drop_last)

    def split(self, num_pipelines: int, pipeline_id: int | None) -> None:
        """Static policies: read pipeline ``pipeline_id``'s share of ``num_pipelines``
        from the next ``iter()`` on (``None``: no share, the iterator yields nothing: a
        worker that joined after its dataset's epoch was split). Every pipeline of an
        epoch must split alike. ``"dynamic"`` needs no split (a no-op)."""
        pipeline = (-1 if pipeline_id is None else int(pipeline_id), int(num_pipelines))
        self._plan.split(pipeline, before=self._restart)

    def _restart(self) -> None:
        """The next ``iter()`` starts afresh (the active iterator is closed)."""
        self.close()
        self._active = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (shuffle order, lease table); a change restarts iteration."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self._restart()
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
        given back) and release the source reader's resources (a new ``iter()`` makes
        them again)."""
        if self._active is not None:
            self._active.close()
        self._reader.close()

    def state_dict(self) -> dict:
        """Small resumable state: epoch, seed and rows consumed so far this epoch."""
        if self._active is not None:
            pos = self._active.position
        else:
            pos = self._resume or 0
        return {
            "dataset_id": self.dataset_id,
            "files": self._fingerprint(),
            "policy": self.policy,
            "pipeline": list(self._plan.pipeline),
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "position": self._plan.position(pos),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``iter()`` continues after the last row consumed. The state
        must be of a loader over the same files (paths and row counts): ``ValueError``
        naming both datasets if not."""
        if state.get("files") != self._fingerprint():
            raise ValueError(
                f"state is for dataset {state.get('dataset_id')!r} over other files "
                f"(fingerprint {state.get('files')!r}), this loader reads "
                f"{self.shards!r} (fingerprint {self._fingerprint()!r})"
            )
        self._plan.check_pipeline(state)
        self.close()
        self._active = None
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.shuffle_buffer = int(state.get("shuffle_buffer", self.shuffle_buffer))
        self._resume = int(state.get("position", 0)) or None

    def progress(self) -> dict:
        """Under ``"dynamic"``: the lease table's counts for this epoch (``total``,
        ``acknowledged``, ``leased``, ``free``, ``complete``, ``failed``). Otherwise
        this pipeline's own rows consumed against its total."""
        return self._plan.progress(self._define, self.dataset_id, self.epoch,
                                   self.state_dict()["position"])

    def __repr__(self) -> str:
        i, n = self._plan.pipeline
        return (f"ArrowLoader({self.shards!r}, batch_size={self.batch_size}, "
                f"policy={self.policy!r}, pipeline={i}/{n}, epoch={self.epoch})")

    def _fingerprint(self) -> str:
        if self._files is None:
            self._files = self.source.fingerprint()
        return self._files

    def _define(self) -> None:
        """Define this dataset's units with the lease service, once per loader (the
        scheduler checks that every worker's loader agrees)."""
        with self._define_lock:
            if not self._defined:
                self.ctx.services.define(self.source.definition(
                    self.dataset_id, self.name, self.seed, self.shuffle))
                self._defined = True

    # -- the pipeline's stages, built per iterator -----------------------------------------
    def _pass(self, epoch: int, position: int) -> ChunkSource:
        """A pass over ``epoch`` from ``position``, as the plan opens it (on a reader of
        the options in force: a seed or shuffle set since opens a new one)."""
        spec = self._spec()
        if spec != self._reader.spec:
            self._reader.close()
            self._reader = self.source.open(spec)
        return self._plan.open(self._reader, epoch, position, self._define,
                               self.ctx.worker is None)

    def _device_stage(self) -> DeviceStage | None:
        """Staging through pinned buffers for CUDA (not with ``collate``: host tables)."""
        if self.device.type != "cuda" or self.collate is not None:
            return None
        return DeviceStage(CudaTransfer(self.device), int(config.get("data.staging-slots", 2)),
                           config.nbytes("data.staging-bytes"))


def _ranges(item: ChunkItem, a: int, b: int) -> list[tuple[int, int]] | None:
    """Rows ``[a, b)`` of a block as row-id intervals (``None``: not a dynamic block)."""
    if item.ids is None:
        return None
    ids = item.ids[a:b]
    return (batching.ranges_of_ascending(ids) if item.ascending
            else batching.ranges_of_ids(ids))


class _LoaderIterator:
    """One pass over a loader's epoch, safe to call from several threads (module doc).

    Under ``"dynamic"``, ``next()`` may be called again after ``StopIteration`` to pick
    up rows that came back to the pool. The prefetch thread converts (and stages) whole
    blocks, the GIL-free part; ``__next__`` cuts ``batch_size`` views from the current
    block, so slicing overlaps with the next block's decoding.
    """

    def __init__(self, loader: ArrowLoader, position: int,
                 stage: DeviceStage | None = None) -> None:
        self.loader = loader
        self.epoch = loader.epoch
        self.position = position
        self._bs = loader.batch_size
        self._restartable = loader._plan.leased  # rows may come back: pass again
        self._source = loader._pass(self.epoch, position)
        self._stage = stage if stage is not None else loader._device_stage()
        self._to_device = (loader.device if loader.device.type != "cpu" and self._stage is None
                           else None)
        self._lock = threading.Lock()  # serializes cuts: _cur, _at, _done, position
        self._feed_lock = threading.Lock()  # guards _feed and _closed against close()
        self._cur: ChunkItem | None = None
        self._at = 0  # next row of _cur
        self._feed: Feed | None = None
        self._done = False
        self._closed = False
        if not self._restartable:
            # a dynamic pass leases its first rows at the first next(), not here: a gang
            # closure's State.sync() may first resume its datasets' ledgers from a
            # checkpoint (rows leased before that could be ones it trained already)
            self._start()

    def _start(self) -> bool:
        """A new feed over a new pass of the source; ``False`` if closed meanwhile."""
        src, stage = self._source, self._stage
        gen = src.chunks()
        if stage is not None:
            gen = stage.stage_all(gen)
        ld = self.loader
        max_rows = ld.prefetch * ld.batch_size if ld.prefetch else None
        with self._feed_lock:
            if self._closed:
                gen.close()
                return False
            self._done = False
            self._feed = Feed(gen, max_rows, f"daskdist-prefetch-{ld.dataset_id}")
        return True

    def __iter__(self) -> _LoaderIterator:
        return self

    @phases.timed(phases.DATA, counts_rows=True)  # a gang member's data phase (SPEC §5.1)
    def __next__(self) -> Any:
        with self._lock:
            parts, ranges, items = self._cut()
            if ranges is not None:  # in the caller's thread: the rows count for its closure
                self._source.delivered(ranges)
        return self._finish(parts, items)

    # -- under the lock ------------------------------------------------------------------
    def _cut(self) -> tuple[list[Any], list[tuple[int, int]] | None, list[ChunkItem]]:
        """The next batch's parts (views), its row ids as intervals (dynamic policy)
        and the blocks they come from.

        A pass that fails ends the cut with its error. Every block before the failure
        was taken (the feed is in order) and every batch cut from them delivered, so
        what the pass still holds is the rows of this unfinished cut and any its reads
        had not given back: all of it goes back to the pool then (the source's
        ``close``), never left leased to a worker whose closures go on."""
        if self._closed:
            raise StopIteration
        bs = self._bs
        cur, a = self._cur, self._at
        if cur is not None and a + bs <= cur.rows:  # fast path: a view of the block
            self._at = a + bs
            self.position += bs
            return [slice_cols(cur.cols, a, a + bs)], _ranges(cur, a, a + bs), [cur]
        parts: list[Any] = []
        id_parts: list[list[tuple[int, int]]] = []
        items: list[ChunkItem] = []
        got = 0
        if (self._done or self._feed is None) and self._restartable and (
                cur is None or a >= cur.rows):
            self._start()  # the first pass, or rows came back to the pool since
        while got < bs:
            if cur is None or self._at >= cur.rows:
                self._cur = None
                cur = self._next_item()
                if cur is None:
                    break
                self._cur, self._at = cur, 0
            a = self._at
            b = min(cur.rows, a + bs - got)
            parts.append(slice_cols(cur.cols, a, b))
            items.append(cur)
            if cur.ids is not None:
                id_parts.append(_ranges(cur, a, b))
            self._at = b
            got += b - a
        if got == 0 or (got < bs and self.loader.drop_last):
            raise StopIteration
        self.position += got
        ranges = None
        if id_parts:
            ranges = id_parts[0] if len(id_parts) == 1 else normalize(
                iv for part in id_parts for iv in part)
        return parts, ranges, items

    def _next_item(self) -> ChunkItem | None:
        """The next block; ``None`` at the end of the pass or once closed."""
        feed = self._feed
        if self._done or feed is None:
            return None
        item = feed.get()  # waits: ends on a block, END, a failure or close()
        if item is CLOSED or self._closed:  # a block read after close() goes back
            return None
        if item is END or isinstance(item, Failure):
            self._done = True
            feed.stop()  # the producer has finished: the join is immediate
            if item is not END:
                self._source.close()  # what the failed pass holds goes back (_cut's doc)
                raise item.exc
            return None
        if self._stage is not None:  # a pending block: wait for its staging (its doc)
            try:
                item = self._stage.resolve(item)
            except BaseException:
                self._done = True
                feed.stop()  # the join ends once the producer returns from its read
                self._source.close()  # blocks read ahead were dropped: their rows go back
                raise
            if item is None or self._closed:
                return None
        return item

    # -- after the lock, in the caller's thread -------------------------------------------
    def _finish(self, parts: list[Any], items: list[ChunkItem]) -> Any:
        """The device step after cutting: stream waits, concatenation, collate, copy."""
        if self._stage is not None:
            self._stage.ready(items)
        cols = concat_cols(parts)
        if self.loader.collate is not None:
            cols = self.loader.collate(cols)
        if self._to_device is not None:
            cols = to_device(cols, self._to_device)
        return cols

    def close(self) -> None:
        """Stop prefetching; give back leased rows that were never handed out.

        From any thread, also while other threads wait in ``next()``: they return
        (``StopIteration``) once the feed is signalled.
        """
        with self._feed_lock:
            if self._closed:
                return
            self._closed = True
            feed = self._feed
        self._source.interrupt()  # a producer waiting for a partition stops waiting
        if feed is not None:
            feed.signal()  # ends the waits of callers and of the producer
            feed.join()  # the producer returns from its read or lease RPC; no lock held
        with self._lock:  # the holder, if any, leaves now that its wait has ended
            if self._feed is not None:
                self._feed.stop()
                self._feed = None
            self._cur = None
            self._source.close()

    def __del__(self) -> None:
        # Only signal the prefetch thread: no join and no lease RPC here, since the
        # collector may run on an event loop the thread (or the RPC) is waiting for.
        # Rows still leased return to the pool when the worker's session ends.
        try:
            self._source.interrupt()  # sets events only
            if self._feed is not None:
                self._feed.signal()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
