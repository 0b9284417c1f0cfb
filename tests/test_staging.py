"""The CUDA device stage's logic on the CPU: layout of a block in one buffer per dtype,
the ring of reused staging slots (reused only once its copy completed), and the loader
run through the stage with a stand-in transfer whose copies happen late, as a GPU's do.
The same path on a real GPU is tested at the end (skipped without CUDA)."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from daskdist.context import InputContext, WorkerContext
from daskdist.data import ArrowLoader
from daskdist.data.convert import convert_chunk
from daskdist.data.loader import _LoaderIterator
from daskdist.data.staging import DeviceStage, StagingRing, piece_rows, plan_layout
from daskdist.errors import InputError
from tests.conftest import wait_until

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
]


class LateFence:
    """Completes the block's copies only when someone waits for it (or queries it after
    ``ready`` is set), like a copy still queued on a GPU stream."""

    def __init__(self, copies):
        self.copies = copies
        self.done = False
        self.ready = False
        self._lock = threading.Lock()

    def query(self):
        if self.ready:
            self.synchronize()
        return self.done

    def synchronize(self):
        with self._lock:
            if not self.done:
                for host, dev in self.copies:
                    dev.copy_(host)  # reads the staging slot now, not when queued
                self.done = True


class LateTransfer:
    """A stand-in for CudaTransfer on the CPU: "device" tensors filled at fence time."""

    def __init__(self):
        self.pending = []
        self.fences = []
        self.host_buffers = 0
        self.waits = 0

    def host_buffer(self, numel, dtype):
        self.host_buffers += 1
        return torch.full((numel,), 7, dtype=dtype)  # garbage until written

    def copy(self, host):
        dev = torch.full_like(host, 9)  # what a read before the copy would see
        self.pending.append((host, dev))
        return dev

    def record(self):
        fence = LateFence(self.pending)
        self.pending = []
        self.fences.append(fence)
        return fence

    def wait(self, staged):
        self.waits += 1
        staged.fence.synchronize()


def table_of(ids):
    return pa.table({
        "a": ids.astype(np.float32) / 2,
        "id": ids,
        "b": ids.astype(np.float32) * 2,
        "s": pa.array([f"r{i}" for i in ids]),
        "k": ids * 3,
        "v": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 2).astype(np.float64)), 2),
        "flag": pa.array(ids % 2 == 0),
    })


def check(batch):
    i = batch["id"]
    assert torch.equal(batch["a"], i.float() / 2) and torch.equal(batch["b"], i.float() * 2)
    assert torch.equal(batch["k"], i * 3) and torch.equal(batch["flag"], i % 2 == 0)
    assert batch["v"].shape == (len(i), 2) and torch.equal(batch["v"][:, 1], i.double())
    assert batch["s"] == [f"r{j}" for j in i.tolist()]
    assert all(t.is_contiguous() for t in batch.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("shuffled", [False, True])
def test_layout_one_aligned_buffer_per_dtype(shuffled):
    ids = np.arange(100, dtype=np.int64)
    index = np.random.default_rng(0).permutation(100) if shuffled else None
    chunk = convert_chunk(table_of(ids), index=index)
    lay = plan_layout(chunk)
    assert set(lay.sizes) == {torch.float32, torch.int64, torch.float64, torch.bool}
    places = lay.stacks + [p for _keys, p in lay.groups] + list(lay.rest.values())
    for dt in lay.sizes:
        mine = sorted((p.offset, p.offset + p.numel) for p in places if p.dtype == dt)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:], strict=False))  # disjoint
        assert all(a * torch.empty((), dtype=dt).element_size() % 128 == 0 for a, _ in mine)
        assert lay.sizes[dt] == mine[-1][1]
    # float32 a and b: one [2, 100] segment (a stack when gathered, a group when not)
    f32 = [p for p in places if p.dtype == torch.float32]
    assert len(f32) == 1 and f32[0].shape == (2, 100)
    groups = [keys for keys, _p in lay.groups]
    assert groups == ([] if shuffled else [("a", "b"), ("id", "k")])  # gathered: stacks
    assert "s" not in lay.rest  # strings stay on the host


def test_ring_reuses_a_slot_only_after_its_copy_completed():
    tr = LateTransfer()
    ring = StagingRing(tr, slots=2)
    staged = []
    for k in range(6):
        ids = np.arange(k * 50, k * 50 + 50, dtype=np.int64)
        staged.append(ring.stage(convert_chunk(table_of(ids))))
    # blocks 0..3 had to be copied before slots 0, 1 were written again; 4, 5 not yet
    assert [f.done for f in tr.fences] == [True] * 4 + [False] * 2
    assert ring.reuse_waits == 4
    assert tr.host_buffers == 2 * 4  # one buffer per dtype per slot, reused after
    for k, (chunk, block) in enumerate(staged):
        block.fence.synchronize()
        b = chunk.slice(0, 50)
        check(b)
        assert b["id"].tolist() == list(range(k * 50, k * 50 + 50))
    sizes = plan_layout(convert_chunk(table_of(ids))).sizes
    block_bytes = sum(n * torch.empty((), dtype=dt).element_size() for dt, n in sizes.items())
    assert block_bytes <= 50 * (4 + 8 + 4 + 8 + 16 + 1) + 4 * 128  # the block's tensors
    assert ring.host_bytes == 2 * block_bytes  # the bound: slots x block bytes


def test_ring_grows_a_slot_for_a_larger_block_and_skips_finished_waits():
    tr = LateTransfer()
    ring = StagingRing(tr, slots=1)
    for n in (10, 40, 20):
        ids = np.arange(n, dtype=np.int64)
        chunk, block = ring.stage(convert_chunk(table_of(ids)))
        block.fence.synchronize()  # consumed before the next block: no wait on reuse
        check(chunk.slice(0, n))
    assert ring.reuse_waits == 0
    assert tr.host_buffers == 4 * 2  # 10 rows, then grown once for 40; 20 fits


def test_a_block_is_handed_on_while_the_next_one_is_still_being_read():
    """A source whose next block takes long (a lazy frame's partition still computing,
    a lease) does not hold back the block before it: its rows are ready as soon as it
    is staged (never one block behind, block 0 out only once block 1 was read: on a GPU
    worker a lazy frame's first batch would wait for the second partition)."""
    from concurrent.futures import ThreadPoolExecutor

    from daskdist.data.sources import ChunkItem

    second_read = threading.Event()

    def blocks():
        yield ChunkItem(convert_chunk(table_of(np.arange(50, dtype=np.int64))), None, 50)
        second_read.wait(30)  # the next partition: computed only when the test says so
        yield ChunkItem(convert_chunk(table_of(np.arange(50, 80, dtype=np.int64))), None, 30)

    stage = DeviceStage(LateTransfer(), slots=2)
    gen = stage.stage_all(blocks())
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(lambda: stage.resolve(next(gen))).result(timeout=10)
        stage.ready([first])
        check(first.cols.slice(0, 50))
        assert first.cols.slice(0, 50)["id"].tolist() == list(range(50))
        assert not second_read.is_set()  # handed on while the next read still waited
        second_read.set()
        rest = [stage.resolve(x) for x in gen]
    assert [r.rows for r in rest] == [30]
    stage.ready(rest)
    assert rest[0].cols.slice(0, 30)["id"].tolist() == list(range(50, 80))


def test_closing_the_stage_drops_the_blocks_not_yet_staged():
    """close() mid-stream: the block being staged is finished, those queued behind it
    are dropped (``resolve`` gives ``None``), and the source is closed."""
    from daskdist.data.sources import ChunkItem

    closed, gate = threading.Event(), threading.Event()

    def blocks():
        try:
            for k in range(10):
                n = 21 if k == 1 else 20  # block 1: its staging waits for the gate
                yield ChunkItem(convert_chunk(table_of(np.arange(n, dtype=np.int64))), None, n)
        finally:
            closed.set()

    stage = DeviceStage(LateTransfer(), slots=2)
    plain = stage.stage

    def staging(item):
        if item.rows == 21:
            gate.wait(10)
        return plain(item)

    stage.stage = staging
    gen = stage.stage_all(blocks())
    pending = [next(gen) for _ in range(10)]
    assert stage.resolve(pending[0]).cols.rows == 20  # staged
    def open_once_dropped():  # block 1's staging ends once the close dropped 2..9
        wait_until(lambda: all(p.staged.cancelled() for p in pending[2:]), 10,
                   "the queued stagings dropped")
        gate.set()

    opener = threading.Thread(target=open_once_dropped)
    opener.start()
    gen.close()  # waits for block 1's staging; blocks 2..9 are dropped
    opener.join()
    assert closed.is_set()
    assert stage.resolve(pending[1]).cols.rows == 21
    assert [stage.resolve(p) for p in pending[2:]] == [None] * 8


def test_a_failing_source_still_hands_on_the_blocks_before_the_failure():
    """The source raises after two blocks while the first is still being staged: both
    blocks are staged (not dropped as on a close), so a consumer gets their rows and
    then the error, never an early end of the pass."""
    from daskdist.data.sources import ChunkItem

    gate = threading.Event()

    def blocks():
        for n in (20, 21):
            yield ChunkItem(convert_chunk(table_of(np.arange(n, dtype=np.int64))), None, n)
        raise OSError("the third partition is unreadable")

    stage = DeviceStage(LateTransfer(), slots=2)
    plain = stage.stage

    def staging(item):
        if item.rows == 20:
            gate.wait(10)  # block 1 stays queued behind it while the source raises
        return plain(item)

    stage.stage = staging
    gen = stage.stage_all(blocks())
    pending = [next(gen), next(gen)]
    # block 0's staging ends a second later: by then the source has raised, with block 1
    # queued (a close would drop it; a failure must not)
    opener = threading.Timer(1.0, gate.set)
    opener.start()
    with pytest.raises(OSError, match="third partition"):
        next(gen)
    opener.join()
    assert [stage.resolve(p).cols.rows for p in pending] == [20, 21]


def write(root, files=3, rows=300, group=70):
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows, dtype=np.int64)
        pq.write_table(table_of(ids), root / f"p{f}.parquet", row_group_size=group)
    return root


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("slots", [1, 2])
def test_loader_through_the_stage_keeps_values_and_order(tmp_path, shuffle, prefetch, slots):
    root = write(tmp_path)

    def loader():
        return ArrowLoader(root, batch_size=64, shuffle=shuffle, seed=4, prefetch=prefetch,
                           shuffle_buffer=150)

    expected = [b["id"].tolist() for b in loader()]
    tr = LateTransfer()
    it = _LoaderIterator(loader(), 0, stage=DeviceStage(tr, slots=slots))
    held = list(it)  # batches kept alive while later blocks are staged in the same slots
    assert [b["id"].tolist() for b in held] == expected
    names = ["a", "id", "b", "s", "k", "v", "flag"]
    for b in held:
        check(b)
        assert list(b) == names  # the schema's order, whatever the staged layout
    assert tr.waits >= len(tr.fences) and len(tr.fences) >= 5  # each block waited on
    assert tr.host_buffers <= slots * 4


def test_cuda_device_without_cuda_is_input_error_naming_it(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    root = write(tmp_path, files=1)
    with pytest.raises(InputError, match=r"'cuda:1'.*no CUDA"):
        ArrowLoader(root, device="cuda:1")
    worker = WorkerContext(0, 1, torch.device("cuda", 0), "tcp://10.0.0.7:4242")
    with pytest.raises(InputError, match=r"'cuda:0'.*worker tcp://10.0.0.7:4242"):
        ArrowLoader(root, InputContext(worker=worker))  # the worker's device by default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shuffle", [False, True])
def test_cuda_loader_values_and_order(tmp_path, shuffle):
    root = write(tmp_path)
    kw = dict(batch_size=64, shuffle=shuffle, seed=4, shuffle_buffer=150)
    cpu = list(ArrowLoader(root, **kw))
    gpu = list(ArrowLoader(root, device="cuda", **kw))
    assert len(gpu) == len(cpu)
    for c, g in zip(cpu, gpu, strict=True):
        assert list(g) == list(c)
        for k, v in c.items():
            if isinstance(v, torch.Tensor):
                assert g[k].device.type == "cuda" and g[k].is_contiguous()
                assert torch.equal(g[k].cpu(), v)
            else:
                assert g[k] == v  # strings stay on the host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_are_views_of_one_device_tensor_per_dtype(tmp_path):
    root = write(tmp_path, files=1, rows=640, group=640)
    it = iter(ArrowLoader(root, batch_size=64, device="cuda", columns=["a", "b", "id"]))
    x, y = next(it), next(it)
    assert x["a"].untyped_storage().data_ptr() == x["b"].untyped_storage().data_ptr()
    assert y["a"].data_ptr() == x["a"].data_ptr() + 64 * 4
    assert x["id"].device == torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loader_from_two_threads_on_their_own_streams(tmp_path):
    root = write(tmp_path)
    it = iter(ArrowLoader(root, batch_size=32, device="cuda", shuffle=True, seed=2,
                          shuffle_buffer=150))
    seen = [[], []]
    errors = []

    def consume(i):
        try:
            stream = torch.cuda.Stream() if i else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                for b in it:
                    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v
                           for k, v in b.items()}
                    check(cpu)
                    seen[i].extend(cpu["id"].tolist())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in ts)
    assert sorted(seen[0] + seen[1]) == list(range(900))


def image_table(ids, pixels=3 * 32 * 32):
    """Image-like rows: ``pixels`` float32 values (12 KiB) beside the id."""
    img = np.repeat(ids.astype(np.float32), pixels)
    return pa.table({"id": ids,
                     "img": pa.FixedSizeListArray.from_arrays(pa.array(img), pixels)})


@pytest.mark.parametrize("slots", [1, 2])
def test_the_ring_is_bounded_in_bytes_whatever_the_rows_hold(tmp_path, slots):
    """Image rows: a 1,000-row block takes 12 MiB; a 1 MiB bound stages it in pieces of
    at most ``1 MiB / slots``, the ring never holds more than the bound, and the batches
    are the CPU loader's, values and order."""
    root = tmp_path / "img"
    root.mkdir()
    for f in range(2):
        pq.write_table(image_table(np.arange(f * 1000, (f + 1) * 1000, dtype=np.int64)),
                       root / f"p{f}.parquet", row_group_size=1000)
    bound = 2**20

    def loader():
        return ArrowLoader(root, batch_size=100, shuffle=True, seed=1, prefetch=2)

    expected = [b["id"].tolist() for b in loader()]
    tr = LateTransfer()
    stage = DeviceStage(tr, slots=slots, max_bytes=bound)
    it = _LoaderIterator(loader(), 0, stage=stage)
    held = list(it)
    assert [b["id"].tolist() for b in held] == expected
    for b in held:
        assert torch.equal(b["img"][:, 0], b["id"].float())
        assert torch.equal(b["img"][:, -1], b["id"].float())
    assert 0 < stage.ring.host_bytes <= bound + slots * 2 * 128  # the bound (+ alignment)
    assert len(tr.fences) >= 2 * 12  # each 12 MiB block went in pieces
    unbounded = DeviceStage(LateTransfer(), slots=slots)
    list(_LoaderIterator(loader(), 0, stage=unbounded))
    assert unbounded.ring.host_bytes >= 12 * 2**20  # what the bound prevents


def test_piece_rows_keeps_at_least_one_row():
    ids = np.arange(10, dtype=np.int64)
    chunk = convert_chunk(image_table(ids))
    row = 8 + 3 * 32 * 32 * 4
    assert piece_rows(chunk, 10 * row) == 10  # fits whole
    assert piece_rows(chunk, 3 * row + 5) == 3
    assert piece_rows(chunk, 100) == 1  # a row larger than the share: alone
