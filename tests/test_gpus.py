"""The Dask GPU convention as pure decisions: reading CUDA_VISIBLE_DEVICES as CUDA and
Dask's NVML do, who is a member under ``members="gpu"``, what a worker reports as its
GPU, and which members share a device (refused under NCCL, naming them). Plus
``gpu_pin``'s per-job slots, on real lock files."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daskdist.core import checks, gpus
from daskdist.core.backends import BackendError, MemberDevice, choose_backend, shared_gpus
from daskdist.plugins import gpu_pin

UUID = "GPU-9baca7f5-0f2f-01ac-6b05-8da14d6e9005"
MIG = "MIG-4a2c3a7e-1b5d-5f0e-9c3b-2d7e6f1a0b9c"

# -- reading CUDA_VISIBLE_DEVICES -------------------------------------------------------

index = st.integers(0, 99).map(str)
uuid = st.from_regex(r"[0-9a-f]{8}-[0-9a-f]{4}", fullmatch=True)
device = st.one_of(index, uuid.map(lambda u: f"GPU-{u}"), uuid.map(lambda u: f"MIG-{u}"))
not_a_device = st.sampled_from(["-1", "NoDevFiles", "", "gpu-0", "GPU-", "cuda:0", "1.5"])


def test_visible_devices_reads_as_cuda_does():
    assert gpus.visible_devices(None) is None  # unset: every device of the host
    assert gpus.visible_devices("") == ()  # no GPU, whatever the host has
    assert gpus.visible_devices("   ") == ()
    assert gpus.visible_devices("1,0") == ("1", "0")  # dask-cuda's rotation
    assert gpus.visible_devices(" 2 , 3 ") == ("2", "3")
    assert gpus.visible_devices("01") == ("1",)
    assert gpus.visible_devices(f"{UUID},{MIG}") == (UUID, MIG)
    assert gpus.visible_devices("0,-1,2") == ("0",)  # CUDA stops at an invalid entry
    assert gpus.visible_devices("NoDevFiles") == ()
    assert gpus.given_gpu("3,0,1,2") == "3"
    assert gpus.given_gpu(MIG) == MIG
    assert gpus.given_gpu("") is None and gpus.given_gpu(None) is None


@given(st.lists(device, max_size=6), not_a_device, st.lists(device, max_size=3))
def test_the_devices_end_at_the_first_entry_that_is_none(head, stop, tail):
    shown = gpus.visible_devices(",".join(head + [stop] + tail))
    assert shown == tuple(head)  # ... and "" (head and tail empty) is no device
    assert gpus.given_gpu(",".join(head)) == (head[0] if head else None)


# -- members="gpu" ------------------------------------------------------------------------
VISIBLE = [None, "", " ", "0", "1,0", UUID, MIG, "NoDevFiles", "-1", "0,-1"]
RESOURCES = [None, {}, {"GPU": 1}, {"gpu": 2}, {"GPU": 0}, {"MEM": 1}]


@pytest.mark.parametrize(("visible", "resources", "count"), itertools.product(
    VISIBLE, RESOURCES, [0, 1, 8]))
def test_has_gpu_every_case(visible, resources, count):
    """A set CUDA_VISIBLE_DEVICES decides alone (a device named or not); unset, a
    declared GPU resource or a GPU on the host."""
    named = visible is not None and visible.strip() not in ("", "NoDevFiles", "-1")
    declared = any(k.lower() == "gpu" and v > 0 for k, v in (resources or {}).items())
    expected = named if visible is not None else (declared or count > 0)
    assert gpus.has_gpu(visible, resources, count) is expected


def test_members_setting_is_checked_naming_it():
    assert checks.members("gpu") == "gpu"
    with pytest.raises(ValueError, match=r"members must be None \(every worker\) or 'gpu'"):
        checks.members("gpus")
    with pytest.raises(TypeError, match="members"):
        checks.members(["gpu"])
    with pytest.raises(ValueError, match="daskdist_create: members"):
        checks.members("GPU", "daskdist_create: members")


# -- what a worker reports --------------------------------------------------------------

def test_gpu_identity_every_case():
    raw = "58e5ea45-b3b8-3a8e-5ad0-1c2b3d4e5f60"  # torch's UUID leaves out "GPU-"
    # given a UUID or a MIG id: that, as given
    assert gpus.gpu_identity(f"{UUID},1", raw, cuda=True) == UUID
    assert gpus.gpu_identity(MIG, "", cuda=False) == MIG
    # given an index: the device's UUID when torch tells it, else the index
    assert gpus.gpu_identity("1,0", raw, cuda=True) == f"GPU-{raw}"
    assert gpus.gpu_identity("1,0", UUID, cuda=True) == UUID
    assert gpus.gpu_identity("1,0", "", cuda=True) == "1"
    assert gpus.gpu_identity("1,0", raw, cuda=False) == "1"  # bound the CPU: what it was given
    # unset: device 0 with CUDA, nothing without
    assert gpus.gpu_identity(None, "", cuda=True) == "0"
    assert gpus.gpu_identity(None, raw, cuda=True) == f"GPU-{raw}"
    assert gpus.gpu_identity(None, "", cuda=False) == ""
    # CUDA_VISIBLE_DEVICES="": no GPU, whatever else
    assert gpus.gpu_identity("", raw, cuda=True) == ""


# -- members sharing a device -------------------------------------------------------------

def rotated(gpus_on_host: int, worker: int) -> str:
    """The CUDA_VISIBLE_DEVICES dask-cuda's LocalCUDACluster gives worker ``worker``."""
    return ",".join(str((worker + i) % gpus_on_host) for i in range(gpus_on_host))


def member(host: int, port: int, visible: str, uuid: str = "") -> MemberDevice:
    """A member on CUDA as a worker with ``visible`` reports itself."""
    return MemberDevice(f"tcp://10.0.0.{host}:{port}", "cuda:0",
                        gpus.gpu_identity(visible, uuid, cuda=True))


@given(st.lists(st.integers(1, 8), min_size=1, max_size=4), st.booleans())
def test_dask_cuda_workers_each_have_their_own_gpu(hosts, uuids):
    """One worker per GPU of each host, as LocalCUDACluster starts them (torch telling
    the devices' UUIDs or not): no two share a device, so NCCL is chosen."""
    members = [member(h, 4000 + w, rotated(n, w), f"GPU-{h}-{w}" if uuids else "")
               for h, n in enumerate(hosts) for w in range(n)]
    assert shared_gpus(members) == {}
    assert choose_backend(members) == "nccl" and choose_backend(members, "nccl") == "nccl"


@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["index", "GPU", "MIG"]),
                          st.integers(0, 3)), min_size=2, max_size=8))
def test_members_given_one_device_are_found_and_nccl_names_them(given_to):
    """Members share a device exactly when given the same UUID / MIG id, or the same
    index on one host; explicit NCCL is refused naming each such pair and the device,
    "auto" is gloo; the others are not named."""
    members, by_device = [], {}
    for port, (host, kind, n) in enumerate(given_to):
        visible = str(n) if kind == "index" else f"{kind}-{n}"
        m = member(host, 5000 + port, visible)
        members.append(m)
        by_device.setdefault((host, n) if kind == "index" else (kind, n), []).append(m.address)
    expected = {tuple(a) for a in by_device.values() if len(a) > 1}
    found = shared_gpus(members)
    assert {tuple(a) for a in found.values()} == expected
    if not expected:
        assert choose_backend(members, "nccl") == "nccl"
        return
    assert choose_backend(members) == "gloo"
    with pytest.raises(BackendError) as e:
        choose_backend(members, "nccl")
    msg = str(e.value)
    for gpu, addresses in found.items():
        assert f"workers {', '.join(addresses)} share GPU {gpu}" in msg
    shared = {addr for addrs in found.values() for addr in addrs}
    assert not [m.address for m in members if m.address not in shared and m.address in msg]


def test_an_index_and_a_uuid_of_one_gpu_are_one_device_when_torch_tells():
    """One worker given "1", another the same GPU's UUID: torch's UUID of the first
    makes them one device; without it (no CUDA bound) they cannot be told apart."""
    a = member(1, 4001, "1,0", UUID)
    b = member(1, 4002, UUID)
    assert shared_gpus([a, b]) == {UUID: [a.address, b.address]}
    with pytest.raises(BackendError, match="share GPU " + UUID):
        choose_backend([a, b], "nccl")


def test_members_on_the_cpu_share_nothing():
    """gloo on CPUs: members given the same GPU but bound to the CPU are not refused."""
    members = [MemberDevice(f"tcp://h:{p}", "cpu", "0") for p in (1, 2)]
    assert shared_gpus(members) == {} and choose_backend(members) == "gloo"


# -- gpu_pin: one job's slots --------------------------------------------------------------

def test_gpu_pin_leaves_a_worker_without_a_gpu_without_one():
    assert gpu_pin.local_gpu(0, "", 8) is None  # CUDA_VISIBLE_DEVICES="": no GPU
    assert gpu_pin.local_gpu(0, "NoDevFiles", 8) is None
    assert gpu_pin.local_gpu(1, "4,5", 0) == "5"
    assert gpu_pin.local_gpu(1, f"{UUID},{MIG}", 0) == MIG


@given(st.integers(1, 8), st.integers(0, 8))
def test_a_jobs_workers_get_distinct_devices_up_to_its_gpus(n_gpus, offset):
    """The workers of one job take slots 0, 1, ...: as many distinct devices as the
    job's CUDA_VISIBLE_DEVICES shows (then they wrap around)."""
    visible = ",".join(str(offset + i) for i in range(n_gpus))
    got = [gpu_pin.local_gpu(slot, visible, 0) for slot in range(n_gpus)]
    assert sorted(got, key=int) == visible.split(",")


def test_the_job_is_the_setting_else_the_batch_job_else_the_scheduler():
    variables = ["SLURM_JOB_ID", "PBS_JOBID"]
    tcp = "tcp://10.0.0.1:8786"
    assert gpu_pin.job_key("mine", {"SLURM_JOB_ID": "7"}, variables, tcp) == "mine"
    assert gpu_pin.job_key(None, {"PBS_JOBID": "9.pbs", "SLURM_JOB_ID": "7"}, variables,
                           tcp) == "SLURM_JOB_ID=7"
    assert gpu_pin.job_key(None, {"PBS_JOBID": "9.pbs"}, variables, tcp) == "PBS_JOBID=9.pbs"
    assert gpu_pin.job_key(None, {"SLURM_JOB_ID": ""}, variables, tcp) == tcp
    assert gpu_pin.job_key(None, {}, variables, "") == "local"


def test_two_jobs_on_a_host_number_their_slots_apart(tmp_path):
    """Workers of two jobs start interleaved on one host: each job's take slots 0, 1
    of its own, so each job's workers get its GPUs 0 and 1 (shared numbering gave job
    A slots 0 and 2, one GPU twice)."""
    import dask

    with dask.config.set({"daskdist.gpu-pin.slots-dir": str(tmp_path)}):
        a, b = gpu_pin.slots_dir("SLURM_JOB_ID=1"), gpu_pin.slots_dir("SLURM_JOB_ID=2")
        assert a != b and a.startswith(str(tmp_path))
        # keys that differ only in characters a file name cannot hold stay apart
        assert gpu_pin.slots_dir("tcp://h:1") != gpu_pin.slots_dir("tcp_//h_1")
        try:
            slots = [gpu_pin.host_slot(d) for d in (a, b, a, b)]
        finally:
            gpu_pin.release_slots()
    assert slots == [0, 0, 1, 1]
    assert [gpu_pin.local_gpu(s, "0,1", 0) for s in slots[::2]] == ["0", "1"]
    assert [gpu_pin.local_gpu(s, "2,3", 0) for s in slots[1::2]] == ["2", "3"]
