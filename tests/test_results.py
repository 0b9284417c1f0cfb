"""A closure's value leaves its worker with its tensors on the host, so
a client without CUDA can fetch what a GPU worker returned. Tested on the CPU with the
target device as a parameter: sent to ``"meta"``, every tensor at every depth must come
back on ``"meta"`` (so each one took the hook); the CUDA case runs where there is CUDA."""

from __future__ import annotations

import pickle

import pytest
import torch

import daskdist as dd
from daskdist.plugins.worker.runner import dump_result

pytestmark = pytest.mark.timeout(120)


class Holder:
    """A user's object with a tensor inside (pickled by reference: importable)."""

    def __init__(self, t):
        self.t = t


def value_on(device: str):
    net = torch.nn.Linear(3, 2).to(device)
    return {
        "loss": torch.tensor(1.5, device=device),
        "batch": [torch.arange(6, device=device).view(2, 3), (torch.ones(2, device=device),)],
        "state": net.state_dict(),
        "param": torch.nn.Parameter(torch.ones(2, device=device)),
        "holder": Holder(torch.zeros(4, device=device)),
        "plain": 7,
    }


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    if isinstance(obj, Holder):
        return tensors(obj.t)
    return []


@pytest.mark.parametrize("local", [False, True], ids=["pickle", "cloudpickle"])
def test_every_tensor_at_every_depth_goes_to_the_host_device(local):
    value = value_on("cpu")
    if local:
        value["fn"] = lambda: 1  # only cloudpickle takes a lambda
    back = pickle.loads(dump_result(value, host="meta"))
    moved = tensors(back)
    assert len(moved) == len(tensors(value)) == 7
    assert all(t.device.type == "meta" for t in moved)
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert back["plain"] == 7 and isinstance(back["holder"], Holder)
    if local:
        assert back["fn"]() == 1


def test_host_tensors_pickle_as_they_are_and_none_opts_out():
    value = value_on("cpu")
    for host in ("cpu", None):
        back = pickle.loads(dump_result(value, host=host))
        assert all(torch.equal(a, b) for a, b in zip(tensors(back), tensors(value),
                                                     strict=True))
        assert all(t.device.type == "cpu" for t in tensors(back))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_leave_as_cpu_copies():
    value = value_on("cuda")
    back = pickle.loads(dump_result(value))
    assert all(t.device.type == "cpu" for t in tensors(back))
    assert torch.equal(back["batch"][0], torch.arange(6).view(2, 3))
    kept = pickle.loads(dump_result(value, host=None))  # opted out: as they were
    assert all(t.is_cuda for t in tensors(kept))


def on_device():
    return value_on(str(dd.get_worker_context().device))


def test_fetched_results_are_on_the_host_from_real_workers():
    from distributed import Client

    from tests.conftest import make_cluster, wait_for_workers

    with make_cluster(2, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="results")
        wait_for_workers(client, coord, 2)
        out = coord.fetch([coord.schedule(on_device) for _ in range(4)])
        for value in out:
            assert all(t.device.type == "cpu" for t in tensors(value))
            assert torch.equal(value["batch"][0], torch.arange(6).view(2, 3))
            assert isinstance(value["holder"], Holder)
        coord.close()
