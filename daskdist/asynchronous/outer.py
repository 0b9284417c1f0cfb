"""Outer optimizers: how the holder of an asynchronously trained model applies one
worker's delta (its pseudo-gradient: the weights it pulled minus its weights after its
inner steps).

- :class:`Nesterov` (the default): DiLoCo's outer step (Douillard et al., "DiLoCo:
  Distributed Low-Communication Training of Language Models", arXiv 2311.08105), here
  one step per push: ``m = momentum * m + delta``; ``w -= lr * (delta + momentum * m)``.
  With stale deltas the momentum amplifies old directions: keep inner rounds short
  (and ``max_staleness`` low), or use :class:`DelayedNesterov`.
- :class:`Average`: ``w -= delta`` (learning rate 1, no momentum): each push moves the
  global model by what the worker learned, as asynchronous SGD applies a gradient.
- :class:`DelayedNesterov`: Asynchronous Local-SGD's delayed Nesterov (Liu et al.,
  "Asynchronous Local-SGD Training for Language Modeling", arXiv 2401.09135): each push
  is a plain step ``w -= lr * delta / N``, and once every ``N`` pushes the momentum
  takes the average of those ``N`` deltas and steps: ``m = momentum * m + mean``;
  ``w -= lr * momentum * m``. ``N`` (``delay``) defaults to the number of workers when
  the push arrives, so a round of pushes by every worker moves the model as one
  synchronous DiLoCo step would.
- :class:`Mixing`: FedAsync's mixing (Xie, Koyejo and Gupta, "Asynchronous Federated
  Optimization", arXiv 1903.03934): the model moves a share ``alpha`` of the way to the
  worker's weights after its round, ``w = (1 - alpha) * w + alpha * (base - delta)``,
  where ``base`` is the version the worker pulled. ``alpha`` defaults to
  ``2 / (N + 1)`` for ``N`` workers: the model is then an exponential average of the
  pushed weights whose pushes are on average as old as in a plain average of the
  latest ``N`` (one round by every worker), ``(N - 1) / 2`` pushes; a single worker's
  push is taken whole. A push whose round took fewer inner steps than the longest
  recent round moves the model that much less, as FedAvg (McMahan et al., arXiv
  1602.05629) weighs a client's model by the examples it learned.
  Unlike a step by the delta, a stale push does not add again what the versions since
  its pull already moved: while the loss falls fast (every worker's round ends near the
  same point) the model goes there instead of overshooting it. The holder keeps the
  versions workers pulled for as long as a push from them can be applied
  (``max_staleness``); a base it does not hold (a new holder's first pushes) counts
  as the current model, which makes this step ``w -= alpha * delta``.

An outer optimizer is pickled to the holder, where it keeps its state (momentum
buffers); that state travels with the standby copy and the checkpoint. Importing this
module loads no torch (the client checks ``outer=`` with it).
"""

from __future__ import annotations

from typing import Any


def _number(value: Any, what: str, lo: float, hi: float, hi_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r:.40}")
    value = float(value)
    if not (lo <= value < hi if hi_open else lo <= value <= hi) or value != value:
        bracket = ")" if hi_open else "]"
        raise ValueError(f"{what} must be in [{lo:g}, {hi:g}{bracket}, got {value!r}")
    return value


class OuterOptimizer:
    """The seam: how a delta becomes a step of the global model. A subclass implements
    :meth:`step` (in place, under ``torch.no_grad``) and keeps its state in
    :meth:`state_dict` / :meth:`load_state_dict` (tensors on the CPU). One that sets
    ``uses_base = True`` is also given ``base=``: the parameters of the version the
    worker pulled (the holder then keeps pulled versions while they can be pushed to);
    one that sets ``uses_steps = True`` is given ``steps=``: the inner steps of the
    push's round."""

    uses_base = False
    uses_steps = False

    def step(self, params: list, deltas: list, workers: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class Nesterov(OuterOptimizer):
    """DiLoCo's Nesterov outer step, one per push (see the module doc)."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        self.lr = _number(lr, "Nesterov: lr", 0.0, 1e6)
        if self.lr <= 0:
            raise ValueError(f"Nesterov: lr must be positive, got {lr!r}")
        self.momentum = _number(momentum, "Nesterov: momentum", 0.0, 1.0, hi_open=True)
        self._m: list = []

    def step(self, params: list, deltas: list, workers: int) -> None:
        import torch

        with torch.no_grad():
            if self.momentum == 0.0:
                for p, d in zip(params, deltas, strict=True):
                    p.sub_(d.to(p.dtype), alpha=self.lr)
                return
            if len(self._m) != len(params):
                self._m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
            for p, d, m in zip(params, deltas, self._m, strict=True):
                d32 = d.to(torch.float32)
                m.mul_(self.momentum).add_(d32)
                p.sub_((d32 + self.momentum * m).to(p.dtype), alpha=self.lr)

    def state_dict(self) -> dict:
        return {"m": [m.clone() for m in self._m]}

    def load_state_dict(self, state: dict) -> None:
        self._m = [m.clone() for m in state.get("m", [])]


class Average(Nesterov):
    """``w -= delta``: learning rate 1, no momentum."""

    def __init__(self) -> None:
        super().__init__(lr=1.0, momentum=0.0)

    def __repr__(self) -> str:
        return "Average()"


class DelayedNesterov(OuterOptimizer):
    """Asynchronous Local-SGD's delayed Nesterov (see the module doc): a plain step of
    ``lr * delta / N`` per push, the momentum's step once every ``N`` pushes."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, delay: int | None = None):
        self.lr = _number(lr, "DelayedNesterov: lr", 0.0, 1e6)
        if self.lr <= 0:
            raise ValueError(f"DelayedNesterov: lr must be positive, got {lr!r}")
        self.momentum = _number(momentum, "DelayedNesterov: momentum", 0.0, 1.0,
                                hi_open=True)
        if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int)
                                  or delay < 1):
            raise ValueError(f"DelayedNesterov: delay must be None (the number of "
                             f"workers) or a positive int, got {delay!r}")
        self.delay = delay
        self._m: list = []
        self._acc: list = []
        self._count = 0

    def step(self, params: list, deltas: list, workers: int) -> None:
        import torch

        n = self.delay or max(1, int(workers))
        with torch.no_grad():
            if len(self._acc) != len(params):
                self._acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
                self._m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
            for p, d, acc in zip(params, deltas, self._acc, strict=True):
                d32 = d.to(torch.float32)
                acc.add_(d32)
                p.sub_(d32.to(p.dtype), alpha=self.lr / n)
            self._count += 1
            if self._count % n:
                return
            for p, acc, m in zip(params, self._acc, self._m, strict=True):
                m.mul_(self.momentum).add_(acc, alpha=1.0 / n)
                p.sub_((self.momentum * m).to(p.dtype), alpha=self.lr)
                acc.zero_()

    def state_dict(self) -> dict:
        return {"m": [m.clone() for m in self._m], "acc": [a.clone() for a in self._acc],
                "count": self._count}

    def load_state_dict(self, state: dict) -> None:
        self._m = [m.clone() for m in state.get("m", [])]
        self._acc = [a.clone() for a in state.get("acc", [])]
        self._count = int(state.get("count", 0))


class Mixing(OuterOptimizer):
    """FedAsync's mixing, ``w = (1 - alpha) * w + alpha * (base - delta)`` (see the
    module doc); ``alpha=None`` is ``2 / (N + 1)`` for the ``N`` workers when the
    push arrives (an exponential average spanning ``N`` pushes). ``by_steps``: a push
    whose round took fewer inner steps than the longest of the last ``4 N`` rounds
    moves the model that much less (``alpha * steps / longest``), as FedAvg weighs a
    client's model by the examples it learned: a slow worker's short round (dynamic
    local updates) no longer pulls the model half way back to its older base. A round
    that reports no step (a loop that steps another optimizer) takes the whole share."""

    uses_base = True
    uses_steps = True

    def __init__(self, alpha: float | None = None, by_steps: bool = True) -> None:
        if alpha is not None:
            alpha = _number(alpha, "Mixing: alpha", 0.0, 1.0)
            if alpha <= 0:
                raise ValueError(f"Mixing: alpha must be in (0, 1], got {alpha!r}")
        if not isinstance(by_steps, bool):
            raise TypeError(f"Mixing: by_steps must be True or False, got {by_steps!r}")
        self.alpha = alpha
        self.by_steps = by_steps
        self._recent: list[int] = []  # the inner steps of the last rounds pushed

    def _share(self, workers: int, steps: int = 0) -> float:
        """How far a push moves the model toward its worker's weights."""
        workers = max(1, int(workers))
        a = self.alpha or 2.0 / (workers + 1)
        if not self.by_steps or steps <= 0:
            return a
        self._recent = [*self._recent[-(4 * workers - 1):], int(steps)]
        return a * steps / max(self._recent)

    def step(self, params: list, deltas: list, workers: int, base: list | None = None,
             steps: int = 0) -> None:
        import torch

        a = self._share(workers, steps)
        with torch.no_grad():
            for p, d, b in zip(params, deltas, base or params, strict=True):
                p32 = p.to(torch.float32)
                pushed = b.to(torch.float32) - d.to(torch.float32)  # the worker's weights
                p.copy_(p32.add_(pushed - p32, alpha=a).to(p.dtype))

    def state_dict(self) -> dict:
        return {"recent": list(self._recent)}

    def load_state_dict(self, state: dict) -> None:
        self._recent = [int(s) for s in state.get("recent", [])]
