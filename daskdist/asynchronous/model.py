"""The global model as its holder keeps it: the module (in host memory), its version, the
outer optimizer, and what pulls, pushes, standby copies and checkpoints read and write.

One thread at a time (the holder's apply thread) calls what changes it; the holder
serves pulls from the bytes packed once per version. No Dask here.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from daskdist.asynchronous import flat
from daskdist.asynchronous.spec import AsyncSpec
from daskdist.core.asynchronous.protocol import Push


class GlobalModel:
    """The one model every worker's rounds train (see the module doc)."""

    def __init__(self, spec: AsyncSpec) -> None:
        module = spec.model()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"async_model: model() must return a torch.nn.Module, got "
                            f"{type(module).__name__}")
        self.module = module.to("cpu")
        named = list(self.module.named_parameters())
        if not named:
            raise ValueError("async_model: the model has no parameters to train")
        self.params = [p for _, p in named]
        self.param_layout = flat.layout_of(named)
        buffers = list(self.module.named_buffers())
        self.buffers = [b for _, b in buffers]
        self.buffer_layout = flat.layout_of(buffers)
        self.outer = spec.outer
        self.max_staleness = spec.max_staleness
        self.version = 0
        self.incarnation = 0
        self._packed: tuple[int, bytes, bytes] | None = None
        # versions pulled, and the parameters of those since replaced, for an outer
        # optimizer that steps from a push's base (``uses_base``); none kept otherwise
        self.keeps_bases = bool(getattr(self.outer, "uses_base", False))
        self.gives_steps = bool(getattr(self.outer, "uses_steps", False))
        self._pulled: set[int] = set()
        self._bases: dict[int, bytes] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters (what a pull fetches and a push sends)."""
        return flat.nbytes(self.param_layout)

    @property
    def layout(self) -> list:
        """Parameters' layout, then buffers' (what a pull reply lists)."""
        return self.param_layout + self.buffer_layout

    def packed(self) -> tuple[int, bytes, bytes]:
        """``(version, parameters, buffers)`` as bytes, packed once per version."""
        if self._packed is None or self._packed[0] != self.version:
            self._packed = (self.version, flat.pack(self.params), flat.pack(self.buffers))
        return self._packed

    def served(self) -> tuple[int, bytes, bytes]:
        """:meth:`packed`, for a pull: its version kept as a base (:meth:`pulled`)."""
        out = self.packed()
        self.pulled(out[0])
        return out

    def pulled(self, version: int) -> None:
        """A worker pulled ``version``: kept as a base while a push from it can apply."""
        if self.keeps_bases:
            self._pulled.add(int(version))

    def _base(self, version: int) -> list | None:
        """The parameters of ``version`` (``None``: the current ones, or not kept: a
        push's base that is not kept counts as the current model)."""
        kept = self._bases.get(version)
        return None if kept is None else flat.unpack(kept, self.param_layout)

    def _replacing(self) -> None:
        """Before a step: keep the current version if it was pulled, and forget what no
        push can apply to any more."""
        if self.version in self._pulled:  # the pull's bytes, or the parameters alone
            packed = self._packed
            self._bases[self.version] = (packed[1] if packed and packed[0] == self.version
                                         else flat.pack(self.params))
        oldest = self.version + 1 - self.max_staleness
        for v in [v for v in self._bases if v < oldest]:
            del self._bases[v]
        for v in list(self._pulled):  # list(): one step under the GIL (pulls add to it)
            if v < oldest:
                self._pulled.discard(v)

    def apply(self, push: Push) -> tuple[bool, int, int, str]:
        """Apply one delta: ``(applied, version, staleness, why refused)``. A delta older
        than ``max_staleness`` versions is refused; one of another model raises
        ``ValueError`` naming the parameter."""
        staleness = max(0, self.version - int(push.base))
        if staleness > self.max_staleness:
            return (False, self.version, staleness,
                    f"stale: {staleness} versions were applied since its pull "
                    f"(max_staleness={self.max_staleness})")
        flat.check_layout(self.param_layout, push.layout, "push")
        deltas = flat.unpack(push.params, self.param_layout)
        pushed = flat.unpack(push.buffers, self.buffer_layout)
        workers = max(1, int(push.workers))
        given: dict[str, Any] = {"steps": int(push.steps)} if self.gives_steps else {}
        with torch.no_grad():
            if self.keeps_bases:
                given["base"] = (self._base(int(push.base))
                                 if int(push.incarnation) == self.incarnation else None)
                self._replacing()
            self.outer.step(self.params, deltas, workers, **given)
            for b, new in zip(self.buffers, pushed, strict=True):
                if b.dtype.is_floating_point:  # averaged over the workers pushing
                    b.add_(new.to(b.dtype) - b, alpha=1.0 / workers)
                else:  # counters (BatchNorm's batches seen): the furthest along
                    torch.maximum(b, new.to(b.dtype), out=b)
        self.version += 1
        return True, self.version, staleness, ""

    # -- copies: the standby's, a checkpoint's ---------------------------------------------
    def snapshot(self) -> tuple[int, bytes]:
        """``(version, blob)``: everything a standby needs to take over."""
        version, params, buffers = self.packed()
        buf = io.BytesIO()
        torch.save({"version": version, "params": params, "buffers": buffers,
                    "outer": self.outer.state_dict()}, buf)
        return version, buf.getvalue()

    def restore(self, blob: bytes) -> int:
        """Take the state of a :meth:`snapshot`; its version."""
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
        params = flat.unpack(state["params"], self.param_layout)
        buffers = flat.unpack(state["buffers"], self.buffer_layout)
        with torch.no_grad():
            for p, t in zip(self.params, params, strict=True):
                p.copy_(t)
            for b, t in zip(self.buffers, buffers, strict=True):
                b.copy_(t)
        self.outer.load_state_dict(state["outer"])
        return int(state["version"])

    def checkpoint_state(self) -> tuple[dict[str, Any], dict]:
        """The module's state (cloned: written while training goes on) and the outer
        optimizer's."""
        return ({k: v.detach().clone() for k, v in self.module.state_dict().items()},
                self.outer.state_dict())
