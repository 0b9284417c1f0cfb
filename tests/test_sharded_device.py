"""ShardedState on one member per device kind: gloo on the CPU here, NCCL on a GPU where
there is one (``-m gpu``). The member shards on its own device, its commits' host copies
are pinned (CUDA) and equal the device shards, a re-formation (a new generation of the
same member) takes the last commit back bit for bit, and a checkpoint round-trips."""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.processes import process_context

pytestmark = pytest.mark.timeout(240)

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def _member(device: str, url: str, out) -> None:  # pragma: no cover - a child process
    try:
        out.put(_run(device, url))
    except Exception:  # noqa: BLE001 - reported to the test
        out.put({"error": traceback.format_exc()})


def _run(device: str, url: str) -> dict:
    from daskdist.collective import create_store, destroy_member, init_member
    from tests.sharded_members import IN, make_state

    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    dev = "cuda:0" if device == "cuda" else "cpu"
    got: dict = {}
    state = make_state(url)
    for gen in (1, 2):
        host, port = create_store(gen, "127.0.0.1")
        init_member(0, 1, host, port, backend, gen, 60.0, device=dev)
        state.sync()
        if gen == 1:
            got["device"] = str(next(state.model.parameters()).to_local().device)
            for i in range(2):
                torch.manual_seed(i)
                state.model(torch.randn(4, IN, device=dev)).pow(2).mean().backward()
                state.optimizer.step()
                state.optimizer.zero_grad()
                state.step += 1
                state.commit()
            committed = state.full_state_dict(optimizer=True)
            saved = state._shards.saved
            saved.wait()
            got["pinned"] = bool(saved.own.is_pinned())
            got["own_on_host"] = saved.own.device.type
            # the host copy holds what the device shards held at the commit
            from daskdist.collective.sharded.layout import views

            live = state._shards.plan(state.model, state.optimizer, 0, 1)
            host_views = views(saved.own, saved.cut.entries, 1, 0)
            got["copy_equal"] = all(torch.equal(h, t.cpu())
                                    for h, t in zip(host_views, live.locals, strict=True))
            # an uncommitted step: the next generation goes back to the commit
            state.model(torch.randn(4, IN, device=dev)).sum().backward()
            state.optimizer.step()
        else:
            again = state.full_state_dict(optimizer=True)
            got["resumed_equal"] = all(torch.equal(committed[k], again[k]) for k in committed)
            got["commits"] = state.commits
    state._durable.store.wait()
    destroy_member()
    # a fresh State (a new job) of the same URL resumes from the checkpoint (commit 2)
    host, port = create_store(3, "127.0.0.1")
    init_member(0, 1, host, port, backend, 3, 60.0, device=dev)
    fresh = make_state(url)
    fresh.sync()
    loaded = fresh.full_state_dict(optimizer=True)
    got["checkpoint_equal"] = all(torch.equal(committed[k], loaded[k]) for k in committed)
    got["checkpoint_commits"] = fresh.commits
    destroy_member()
    return got


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_one_member_shards_on_its_device_and_resumes_bit_for_bit(device, tmp_path):
    ctx = process_context()
    out = ctx.Queue()
    p = ctx.Process(target=_member, args=(device, str(tmp_path / "ckpt"), out), daemon=True)
    p.start()
    try:
        got = out.get(timeout=200)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert "error" not in got, got.get("error")
    assert got["device"].startswith(device)
    assert got["own_on_host"] == "cpu" and got["pinned"] == (device == "cuda")
    assert got["copy_equal"] and got["resumed_equal"] and got["commits"] == 2
    assert got["checkpoint_equal"] and got["checkpoint_commits"] == 2
