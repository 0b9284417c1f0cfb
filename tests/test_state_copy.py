"""The elastic State's committed copy: one copy, in host memory
(pinned when CUDA), refilled in place and filled asynchronously; a checkpoint's named
objects go back to the device they were on. The logic runs on the CPU with the device
as a parameter; the CUDA parts run where there is CUDA."""

from __future__ import annotations

import pytest
import torch

import daskdist as dd
from daskdist.collective.state.snapshot import HostCopy, like

pytestmark = pytest.mark.timeout(60)

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def trained(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), 0.1)
    step(model, opt, device)
    return model, opt


def step(model, opt, device):
    opt.zero_grad()
    model(torch.ones(3, 4, device=device)).pow(2).mean().backward()
    opt.step()


def flat(model):
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])


@pytest.mark.parametrize("device", DEVICES)
def test_one_host_copy_refilled_in_place(device):
    model, opt = trained(device)
    value = (model.state_dict(), opt.state_dict(), {"step": 3, "t": torch.ones(2, device=device)})
    copy = HostCopy().fill(value)
    assert all(t.device.type == "cpu" for t in copy.host)  # nothing kept on the device
    # pinned where the tensor was on CUDA (Adam's step counters stay on the CPU)
    assert [t.is_pinned() for t in copy.host] == [d.type == "cuda" for d in copy.devices]
    assert any(d.type == "cuda" for d in copy.devices) == (device == "cuda")
    buffers = [t.data_ptr() for t in copy.host]
    before = flat(model)
    step(model, opt, device)  # the live state moves on; the copy does not
    model_sd, opt_sd, objects = copy.value()
    assert torch.equal(torch.cat([model_sd[k].flatten() for k in ("0.weight", "0.bias",
                       "1.weight", "1.bias", "2.weight", "2.bias")]), before)
    assert getattr(model_sd, "_metadata", None) is not None  # module versions kept
    assert objects["step"] == 3 and objects["t"].device.type == "cpu"
    objects = {"step": 4, "t": torch.ones(2, device=device)}
    copy.fill((model.state_dict(), opt.state_dict(), objects))
    assert [t.data_ptr() for t in copy.host] == buffers  # refilled in place
    _, opt_sd, objects = copy.value(to_devices=True)  # fresh tensors where they were
    assert objects["t"].device.type == device
    assert all(objects["t"].data_ptr() != b for b in buffers)


@pytest.mark.parametrize("device", DEVICES)
def test_restore_goes_back_to_the_commit_and_never_aliases_it(device):
    model, opt = trained(device)
    state = dd.collective.State(model=model, optimizer=opt, step=1,
                                seen=torch.zeros(3, device=device))
    committed = flat(model)
    for _ in range(2):
        step(model, opt, device)  # train on from the restored state...
        state.step += 1
        state.seen += 1
        state.restore()  # ...and back: the same commit each time (no aliasing)
        assert torch.equal(flat(model), committed) and state.step == 1
        assert torch.equal(state.seen.cpu(), torch.zeros(3)) and state.seen.device.type == device
    assert opt.state_dict()["state"], "the optimizer's state came back"
    # what it holds is one copy in host memory (nothing in flight: no second one)
    one = HostCopy().fill((model.state_dict(), opt.state_dict(),
                           {"step": 1, "seen": torch.zeros(3)}))
    assert all(t.device.type == "cpu" for t in one.host)
    assert state.commit_bytes == one.nbytes


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_checkpoints_objects_go_back_to_the_device_they_were_on(device):
    """Checkpoints are read onto the CPU; each object's tensors go back to the device of
    the State's own object at the same place (``meta`` stands for CUDA here)."""
    current = {"counts": torch.zeros(4, device=device), "nested": [torch.ones(1, device=device)],
               "step": 0}
    loaded = {"counts": torch.arange(4.0), "nested": [torch.ones(1)], "step": 7,
              "new": torch.ones(2)}
    out = like(loaded, current)
    assert out["counts"].device.type == device and out["nested"][0].device.type == device
    assert out["step"] == 7 and out["new"].device.type == "cpu"  # nothing to follow: as read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resuming_a_checkpoint_keeps_cuda_objects_on_cuda(tmp_path):
    from daskdist.collective.state.checkpoint import Durable
    from daskdist.collective.state.keeper import Subject
    from daskdist.collective.state.replica import ReplicaKeeper

    durable = Durable(str(tmp_path), every=1)
    committed = HostCopy().fill((None, None, {"counts": torch.arange(4.0, device="cuda")}))
    durable.write("state", 1, committed.value(), None, wait=True)
    again = ReplicaKeeper(Subject(None, None, {"counts": torch.zeros(4, device="cuda")}))
    again.resume(durable, 1)
    counts = again.subject.objects["counts"]
    assert counts.is_cuda and counts.tolist() == [0.0, 1.0, 2.0, 3.0]
