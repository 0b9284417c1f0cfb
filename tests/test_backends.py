"""The backend decision (pure): NCCL only when every member has a GPU of its own."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daskdist.core.backends import (
    BackendError,
    MemberDevice,
    choose_backend,
    host_of,
    shared_gpus,
)

A, B, C = "tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002", "tcp://10.0.0.2:4001"


def test_own_gpus_pick_nccl():
    members = [MemberDevice(A, "cuda:0", "GPU-a"), MemberDevice(B, "cuda:0", "GPU-b")]
    assert choose_backend(members) == "nccl"
    assert choose_backend(members, "nccl") == "nccl"
    assert choose_backend(members, "gloo") == "gloo"
    assert shared_gpus(members) == {}


def test_shared_gpu_auto_is_gloo_and_explicit_nccl_names_workers_and_gpu():
    members = [MemberDevice(A, "cuda:0", "GPU-a"), MemberDevice(B, "cuda:0", "GPU-a"),
               MemberDevice(C, "cuda:0", "GPU-c")]
    assert choose_backend(members) == "gloo"
    assert shared_gpus(members) == {"GPU-a": [A, B]}
    with pytest.raises(BackendError) as e:
        choose_backend(members, "nccl")
    msg = str(e.value)
    assert A in msg and B in msg and "GPU-a" in msg and C not in msg
    assert "gpu_pin" in msg and "dask-cuda" in msg


def test_without_uuids_the_same_host_and_device_is_one_gpu():
    same_host = [MemberDevice(A, "cuda:0"), MemberDevice(B, "cuda:0")]
    assert choose_backend(same_host) == "gloo"
    other_hosts = [MemberDevice(A, "cuda:0"), MemberDevice(C, "cuda:0")]
    assert choose_backend(other_hosts) == "nccl"
    assert host_of("tls://[::1]:80".replace("[::1]", "host")) == "host"


def test_cpu_members():
    cpu = [MemberDevice(A, "cpu"), MemberDevice(B, "cpu")]
    assert choose_backend(cpu) == "gloo"
    with pytest.raises(BackendError, match="CUDA on every member"):
        choose_backend(cpu, "nccl")
    with pytest.raises(BackendError, match="unknown backend"):
        choose_backend(cpu, "mpi")


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["cpu", "cuda:0"]),
                          st.integers(0, 3)), min_size=1, max_size=8))
def test_auto_is_nccl_exactly_when_every_member_has_its_own_gpu(spec):
    members = [MemberDevice(f"tcp://h{h}:{i}", dev, f"GPU-{g}" if dev != "cpu" else "")
               for i, (h, dev, g) in enumerate(spec)]
    gpus = [m.gpu for m in members]
    own = all(m.device != "cpu" for m in members) and len(set(gpus)) == len(gpus)
    assert choose_backend(members) == ("nccl" if own else "gloo")
