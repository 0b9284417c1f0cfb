"""The worker-side parts of an asynchronous model, in one process: the outer optimizers'
steps (DiLoCo's Nesterov, Average, Asynchronous Local-SGD's delayed Nesterov, FedAsync's
mixing from the version pulled, which the global model keeps while it can be pushed to), the flat
bytes a pull and a push carry, the global model's staleness bound and buffers, a model
of other parameters named, and a push outside a closure refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import daskdist as dd
from daskdist.asynchronous import flat
from daskdist.asynchronous.model import GlobalModel
from daskdist.asynchronous.replica import ReplicaPool
from daskdist.asynchronous.spec import AsyncSpec
from daskdist.core.asynchronous.protocol import Push

pytestmark = pytest.mark.timeout(60)


def test_average_applies_a_delta_as_it_is():
    p = [torch.tensor([1.0, 2.0])]
    dd.asynchronous.Average().step(p, [torch.tensor([0.5, -1.0])], workers=3)
    assert p[0].tolist() == [0.5, 3.0]


def test_nesterov_is_diloco_s_outer_step():
    opt = dd.asynchronous.Nesterov(lr=0.5, momentum=0.9)
    p = [torch.zeros(1)]
    opt.step(p, [torch.ones(1)], workers=1)  # m = 1; w -= 0.5 * (1 + 0.9 * 1)
    assert p[0].item() == pytest.approx(-0.95)
    opt.step(p, [torch.ones(1)], workers=1)  # m = 1.9; w -= 0.5 * (1 + 0.9 * 1.9)
    assert p[0].item() == pytest.approx(-0.95 - 0.5 * 2.71)
    state = opt.state_dict()
    other = dd.asynchronous.Nesterov(lr=0.5, momentum=0.9)
    other.load_state_dict(state)
    assert other.state_dict()["m"][0].item() == pytest.approx(1.9)


def test_delayed_nesterov_steps_plainly_and_moves_momentum_every_n_pushes():
    opt = dd.asynchronous.DelayedNesterov(lr=1.0, momentum=0.5)
    p = [torch.zeros(1)]
    opt.step(p, [torch.tensor([2.0])], workers=2)  # plain: w -= 2 / 2
    assert p[0].item() == pytest.approx(-1.0)
    opt.step(p, [torch.tensor([4.0])], workers=2)  # plain -2; m = mean 3; w -= 0.5 * 3
    assert p[0].item() == pytest.approx(-1.0 - 2.0 - 1.5)
    assert opt.state_dict()["count"] == 2


def test_mixing_moves_the_model_a_share_of_the_way_to_the_pushed_weights():
    opt = dd.asynchronous.Mixing()
    p = [torch.tensor([3.0])]
    # the worker pulled 1.0 and ended at 0.0 (delta 1): with 3 workers the model goes
    # half of the way (2 / (N + 1)), with one it takes the pushed weights
    opt.step(p, [torch.tensor([1.0])], workers=3, base=[torch.tensor([1.0])])
    assert p[0].item() == pytest.approx(1.5)
    opt.step(p, [torch.tensor([1.0])], workers=1, base=[torch.tensor([1.0])])
    assert p[0].item() == pytest.approx(0.0)
    p = [torch.tensor([3.0])]
    # no base kept: the current model is the base (a step of alpha * delta)
    dd.asynchronous.Mixing(alpha=0.25).step(p, [torch.tensor([1.0])], workers=3)
    assert p[0].item() == pytest.approx(2.75)
    with pytest.raises(ValueError, match="alpha"):
        dd.asynchronous.Mixing(alpha=0)


def test_mixing_weighs_a_push_by_the_inner_steps_of_its_round():
    """A round with half the inner steps of the longest recent one moves the model half
    as far (FedAvg's weighting by examples); the record of recent rounds travels with
    the state (a standby's copy); a round that reports no step, or ``by_steps=False``,
    takes the whole share."""
    def push(opt, at: float, steps: int) -> float:  # the worker ended at 0.0
        p = [torch.tensor([at])]
        opt.step(p, [torch.tensor([at])], workers=3, base=[torch.tensor([at])], steps=steps)
        return p[0].item()

    opt = dd.asynchronous.Mixing(alpha=0.5)
    assert push(opt, 4.0, 50) == pytest.approx(2.0)  # the longest round: half the way
    assert push(opt, 4.0, 25) == pytest.approx(3.0)  # half the steps: a quarter
    assert push(opt, 4.0, 0) == pytest.approx(2.0)  # no step reported: the whole share
    copy = dd.asynchronous.Mixing(alpha=0.5)
    copy.load_state_dict(opt.state_dict())
    assert push(copy, 4.0, 10) == pytest.approx(3.6)  # 10 of the 50 it remembers
    assert push(dd.asynchronous.Mixing(alpha=0.5, by_steps=False), 4.0, 10) == \
        pytest.approx(2.0)
    with pytest.raises(TypeError, match="by_steps"):
        dd.asynchronous.Mixing(by_steps=1)


def test_mixing_pushes_stale_by_two_versions_step_from_the_version_they_pulled():
    """Three pushes, each from a version two behind, all of whose workers ended at the
    same weights: mixing goes to those weights (no overshoot), whatever the staleness;
    a delta step from the current model would overshoot them."""
    gm = GlobalModel(AsyncSpec("m", net, lambda p: torch.optim.SGD(p, lr=0.1),
                               dd.asynchronous.Mixing(alpha=0.5), 4))
    target = [torch.full_like(p, 7.0) for p in gm.params]
    bases = {}
    for v in range(2):  # two workers pull versions 0 and 1 as they are made
        gm.pulled(v)
        bases[v] = [p.detach().clone() for p in gm.params]
        deltas = [b - t for b, t in zip(bases[v], target, strict=True)]
        assert gm.apply(push_of(gm, v, deltas, list(gm.buffers)))[0]
    for v in range(2):  # pulled again, pushed two versions late from what they pulled
        deltas = [b - t for b, t in zip(bases[v], target, strict=True)]
        applied, _, staleness, _ = gm.apply(push_of(gm, v, deltas, list(gm.buffers)))
        assert applied and staleness == 2
    # 1 - 0.5 ** 4 of the way from the start: no step past the target
    assert all(((p - 7.0).abs() <= (b - 7.0).abs() / 16 + 1e-5).all()
               for p, b in zip(gm.params, bases[0], strict=True))
    assert set(gm._bases) == {0, 1}  # noqa: SLF001 - what it keeps, and no more
    gm.apply(push_of(gm, 3, [torch.zeros_like(p) for p in gm.params], list(gm.buffers)))
    assert set(gm._bases) == {1}  # version 0 can no longer be pushed to (max_staleness 4)


class _Recording(dd.asynchronous.OuterOptimizer):
    """An outer optimizer that wants the base: records it, steps by the delta."""

    uses_base = True

    def __init__(self):
        self.bases = []

    def step(self, params, deltas, workers, base=None):
        self.bases.append(None if base is None else [b.clone() for b in base])
        for p, d in zip(params, deltas, strict=True):
            p.sub_(d)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), min_size=1, max_size=40),
       st.integers(0, 4))
def test_a_push_gets_the_version_it_pulled_while_it_can_apply(ops, max_staleness):
    """Pulls of the current version and pushes from any version pulled before, in any
    order: a push that applies is given exactly the parameters of the version its worker
    pulled (or none when that is the current one), and the holder keeps no version that
    no push can apply to any more."""
    outer = _Recording()
    gm = GlobalModel(AsyncSpec("m", net, lambda p: torch.optim.SGD(p, lr=0.1), outer,
                               max_staleness))
    pulled: dict[int, list] = {}
    for pull, back in ops:
        if pull or not pulled:
            gm.pulled(gm.version)
            pulled[gm.version] = [p.detach().clone() for p in gm.params]
            continue
        base = sorted(pulled)[max(0, len(pulled) - 1 - back)]
        deltas = [torch.full_like(p, 0.5) for p in gm.params]
        current = gm.version
        applied = gm.apply(push_of(gm, base, deltas, list(gm.buffers)))[0]
        assert applied == (current - base <= max_staleness)
        if applied:
            got = outer.bases[-1]
            if base == current:
                assert got is None
            else:
                assert got is not None and all(
                    torch.equal(a, b) for a, b in zip(got, pulled[base], strict=True))
        kept = set(gm._bases)  # noqa: SLF001 - what the holder keeps
        assert all(gm.version - v <= max_staleness and v in pulled for v in kept)


@pytest.mark.parametrize("bad", [{"lr": 0}, {"lr": -1.0}, {"momentum": 1.0},
                                 {"momentum": "0.9"}])
def test_outer_settings_are_checked(bad):
    with pytest.raises((TypeError, ValueError)):
        dd.asynchronous.Nesterov(**bad)
    with pytest.raises(ValueError, match="delay"):
        dd.asynchronous.DelayedNesterov(delay=0)


def test_flat_bytes_keep_every_dtype_and_shape():
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3),
               torch.tensor([1, 2, 3], dtype=torch.int64),
               torch.tensor([0.5, 1.5, 2.5], dtype=torch.bfloat16)]
    layout = flat.layout_of((f"t{i}", t) for i, t in enumerate(tensors))
    data = flat.pack(tensors)
    assert len(data) == flat.nbytes(layout) and len(data) % flat.ALIGN == 0
    for a, b in zip(tensors, flat.unpack(data, layout), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_model_of_other_parameters_is_named():
    a = flat.layout_of(torch.nn.Linear(4, 2).named_parameters())
    b = flat.layout_of(torch.nn.Linear(4, 3).named_parameters())
    with pytest.raises(ValueError, match="parameter 'weight'"):
        flat.check_layout(a, b, "push")
    c = flat.layout_of(torch.nn.Sequential(torch.nn.Linear(4, 2)).named_parameters())
    with pytest.raises(ValueError, match="parameter 'weight' of the global model is missing"):
        flat.check_layout(a, c, "push")


def net():
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))


def spec(max_staleness=1):
    return AsyncSpec("m", net, lambda p: torch.optim.SGD(p, lr=0.1),
                     dd.asynchronous.Average(), max_staleness)


def push_of(gm, base, deltas, buffers, workers=2):
    return Push("m", "p", "s", "w", base, gm.incarnation, gm.param_layout, flat.pack(deltas),
                flat.pack(buffers), [], 1, 0.1, 0, workers)


def test_the_global_model_applies_refuses_stale_and_averages_buffers():
    gm = GlobalModel(spec(max_staleness=1))
    before = [p.detach().clone() for p in gm.params]
    deltas = [torch.ones_like(p) for p in gm.params]
    buffers = [b.clone() + 2 if b.dtype.is_floating_point else b.clone() + 5
               for b in gm.buffers]
    assert gm.apply(push_of(gm, 0, deltas, buffers)) == (True, 1, 0, "")
    assert all(torch.equal(p, b - 1) for p, b in zip(gm.params, before, strict=True))
    mean = dict(gm.module.named_buffers())["1.running_mean"]
    assert torch.allclose(mean, torch.ones(2))  # half-way to the pushed 2 (2 workers)
    assert dict(gm.module.named_buffers())["1.num_batches_tracked"].item() == 5
    assert gm.apply(push_of(gm, 0, deltas, buffers))[0] is True  # staleness 1: ok
    applied, version, staleness, why = gm.apply(push_of(gm, 0, deltas, buffers))
    assert (applied, version, staleness) == (False, 2, 2) and "max_staleness=1" in why
    version, blob = gm.snapshot()
    other = GlobalModel(spec())
    assert other.restore(blob) == 2
    assert all(torch.equal(a, b) for a, b in zip(other.params, gm.params, strict=True))


def test_a_push_or_pull_outside_a_closure_names_the_call():
    pool = ReplicaPool(spec(), None)
    with pytest.raises(RuntimeError, match=r"replica.push\(\) must run inside a closure"):
        pool.push()
    with pytest.raises(RuntimeError, match=r"replica.pull\(\) must run inside a closure"):
        pool.pull()
    assert pool.replicas == 1 and isinstance(pool.model, torch.nn.Sequential)
    # no pace measured yet: a short first round (it measures it; its delta stays small)
    assert pool.suggested_steps(50) == 12 and pool.suggested_steps(2) == 1
    pool.client.speed = 0.5  # as a push's answer sets it
    assert pool.suggested_steps(50) == 25
