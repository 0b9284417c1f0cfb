"""In-process unit tests of the collective package's pure parts (no process group)."""

from __future__ import annotations

import os

import pytest
import torch

from daskdist.collective import (
    CollectiveGroup,
    HostsUpdatedInterrupt,
    State,
    backend_for,
    bind_device,
    get_group,
    mark_peer_lost,
)
from daskdist.collective.replicas import _buckets

pytestmark = pytest.mark.timeout(30)


def test_backend_for_auto_picks_nccl_only_when_every_member_has_cuda():
    assert backend_for(["cuda:0", "cuda:0"]) == "nccl"
    assert backend_for([torch.device("cuda", 0), "cpu"]) == "gloo"
    assert backend_for(["cpu"]) == "gloo"
    assert backend_for(["cuda:0"], "gloo") == "gloo"
    assert backend_for(["cuda:0"], "NCCL") == "nccl"
    with pytest.raises(ValueError, match="CUDA on every member"):
        backend_for(["cuda:0", "cpu"], "nccl")
    with pytest.raises(ValueError, match="unknown backend"):
        backend_for(["cpu"], "mpi")
    with pytest.raises(ValueError, match="at least one"):
        backend_for([])


def test_bind_device_matches_cuda_availability():
    dev = bind_device()
    assert dev == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))


def test_collective_group_handle():
    g = CollectiveGroup(2, 3, ("tcp://a:1", "tcp://b:2"), "gloo")
    assert (g.world_size, g.generation, g.backend) == (2, 3, "gloo")
    assert "generation=3" in repr(g)
    with pytest.raises(ValueError):
        CollectiveGroup(3, 1, ("tcp://a:1",))


def test_get_group_without_a_group_is_a_clear_runtime_error():
    with pytest.raises(RuntimeError, match="no collective group is formed"):
        get_group()


def test_mark_peer_lost_without_a_group_is_harmless():
    mark_peer_lost(0)


def test_state_objects_are_attributes_and_restore_is_local():
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(m.parameters())
    state = State(m, opt, step=0, seen=[])
    assert state.step == 0 and state.model is m and state.optimizer is opt
    state.step = 5
    state.seen.append(1)
    with torch.no_grad():
        m.weight.fill_(3.0)
    state.save()
    state.step = 6
    state.seen.append(2)
    with torch.no_grad():
        m.weight.zero_()
    state.restore()
    assert state.step == 5 and state.seen == [1]
    assert torch.all(m.weight == 3.0)
    with pytest.raises(AttributeError):
        _ = state.missing
    assert issubclass(HostsUpdatedInterrupt, RuntimeError)


def test_buckets_split_by_dtype_and_size_in_order():
    ts = [torch.zeros(256), torch.zeros(3, dtype=torch.int64), torch.zeros(256), torch.zeros(10)]
    out = list(_buckets(ts, bucket_mb=1500 / 2**20))  # 1500 bytes: one 1 KiB tensor each
    kinds = [[(t.dtype, t.numel()) for t in b] for b in out]
    assert kinds == [
        [(torch.float32, 256)],
        [(torch.float32, 256), (torch.float32, 10)],
        [(torch.int64, 3)],
    ]


def test_init_member_gives_up_connecting_to_a_dead_rank0_when_told():
    import socket
    import threading
    import time

    from daskdist.collective import bootstrap, init_member
    from daskdist.errors import CollectiveError

    with socket.socket() as s:  # a port nobody listens on (rank 0 is gone)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gen = 10_000
    box: dict = {}

    def join():
        try:
            init_member(1, 2, "127.0.0.1", port, "gloo", gen, 30.0)
        except BaseException as e:
            box["err"], box["at"] = e, time.monotonic()

    before = set(bootstrap.PROCESS.waiters)  # a leftover thread's wait is not ours
    th = threading.Thread(target=join)
    th.start()
    deadline = time.monotonic() + 10
    while not set(bootstrap.PROCESS.waiters) - before and time.monotonic() < deadline:
        time.sleep(0.001)  # condition poll with a deadline: init is connecting
    t0 = time.monotonic()
    mark_peer_lost(gen)
    th.join(10)
    assert isinstance(box.get("err"), CollectiveError), box
    assert box["at"] - t0 < 10.0  # not the init's 30 s timeout: the mark ended it


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    found.append(addr)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_rendezvous_store_listens_on_the_given_interface_only_and_only_while_needed():
    from daskdist.collective import create_store, destroy_member

    host, port = create_store(987654, "127.0.0.1", timeout=5)
    assert host == "127.0.0.1"
    # 127.0.0.1 as /proc writes it; never 0.0.0.0 or :: (every interface)
    assert _listening(port) == ["0100007F"]
    destroy_member()
    assert _listening(port) == []


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_the_next_stores_socket_is_held_until_a_store_opens_on_it():
    """The port reported for the next store listens (on the given interface only) and
    stays the same until a store opens on it; then a new one is held. A port not held
    here any more is refused by name; ``destroy_member`` closes the held socket."""
    from daskdist.collective import create_store, destroy_member, spare_store_port
    from daskdist.errors import CollectiveError

    port = spare_store_port("127.0.0.1")
    assert spare_store_port("127.0.0.1") == port
    assert _listening(port) == ["0100007F"]
    assert create_store(987655, "127.0.0.1", timeout=5, port=port) == ("127.0.0.1", port)
    assert _listening(port) == ["0100007F"]  # the store's now
    nxt = spare_store_port("127.0.0.1")
    assert nxt != port
    with pytest.raises(CollectiveError, match=f"127.0.0.1:{port}"):
        create_store(987656, "127.0.0.1", timeout=5, port=port)
    destroy_member()
    assert _listening(port) == [] and _listening(nxt) == []
    with pytest.raises(CollectiveError, match=f"127.0.0.1:{nxt}"):
        create_store(987657, "127.0.0.1", timeout=5, port=nxt)


def test_state_ids_are_minted_alike_where_states_are_made():
    """Every worker builds a per-worker resource, and every rank runs a gang closure,
    the same way: States made there get the same ids everywhere (their commit keys, and
    the scheduler's record that they committed). Elsewhere an id is local and unique."""
    from daskdist.session.scope import ClosureScope, closure_scope, minting

    with minting("resource-abc"):
        a, b = State(step=0), State(step=1)
    assert (a._id, b._id) == ("resource-abc/0", "resource-abc/1")
    with closure_scope(ClosureScope(origin="owner-g3")):
        with minting("resource-x"):  # a resource built lazily inside a closure
            c = State()
        d, e = State(), State()
    assert (c._id, d._id, e._id) == ("resource-x/0", "owner-g3/0", "owner-g3/1")
    f, g = State(), State()
    assert f._id != g._id and f._id.startswith("local-")
