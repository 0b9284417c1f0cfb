"""ShardedState: elastic state for a model sharded over the group with FSDP2 (SPEC §4.5).

``ShardedState(model=build, optimizer=make, shard=shard, **objects)`` is a
:class:`~daskdist.collective.state.elastic.State` (commit, restore, sync, interrupts at the
same commit on every rank, reset callbacks, rows acknowledged by commits,
``checkpoint_to``) that keeps its copies with a
:class:`~daskdist.collective.sharded.keeper.ShardKeeper`: its model is built, sharded and
loaded anew in every generation of the group (``sync()``: reset callbacks run before,
with the previous commit's objects and optimizer hyperparameters, which they may
change; then the newest commit is loaded *resharded* to the new world size), and a
commit keeps this rank's shard and a copy of its ring predecessor's, about 2/N of the
state per rank, so the loss of any single member (a host's members, when their copies
are on other hosts) loses no commit. Otherwise ``sync()`` loads the newest durable
checkpoint (``checkpoint_to``: every rank writes its own part), else raises
``CollectiveError``, never a silent fresh start. ``full_state_dict()`` (a collective)
gathers the whole model on every rank.

The committed state after a re-formation equals the last commit before it, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from daskdist.collective.sharded.fsdp import fully_shard_all
from daskdist.collective.sharded.keeper import ShardKeeper
from daskdist.collective.state.elastic import State, begin
from daskdist.collective.state.keeper import Subject

__all__ = ["ShardedState"]


class ShardedState(State):
    """State (SPEC §4, §4.1–4.3) of a model sharded over the group with FSDP2 (§4.5).

    ``model``: a function building the whole model (on every rank, in every generation);
    ``optimizer``: a function of the parameters making the optimizer; ``shard``:
    ``shard(model, mesh)`` shards it in place (default ``fully_shard(model,
    mesh=mesh)``); ``objects``: attributes committed with it. ``state.model`` and
    ``state.optimizer`` are the current generation's, after ``sync()``.
    """

    def __init__(
        self,
        model: Callable[[], torch.nn.Module],
        optimizer: Callable[[Iterable[torch.nn.Parameter]], Any] | None = None,
        shard: Callable[[torch.nn.Module, Any], Any] | None = None,
        **objects: Any,
    ):
        for name, fn in (("model", model), ("optimizer", optimizer), ("shard", shard)):
            if fn is not None and (not callable(fn) or isinstance(fn, torch.nn.Module)):
                raise TypeError(
                    f"ShardedState: {name}= takes a function (model=lambda: Net(), "
                    f"optimizer=lambda params: AdamW(params), shard=lambda model, mesh: "
                    f"...), got {type(fn).__name__}: the model is built anew in every "
                    f"generation of the group")
        if model is None:
            raise TypeError("ShardedState: model= (a function building the model) is required")
        shards = ShardKeeper(Subject(None, None, dict(objects)), model, optimizer,
                             shard or fully_shard_all)
        object.__setattr__(self, "_shards", shards)
        begin(self, shards)

    def __repr__(self) -> str:
        names = ", ".join(sorted(self._shards.subject.objects))
        return (f"ShardedState(model={getattr(self._shards.build, '__name__', 'fn')}, "
                f"generation={self._shards.built}, commits={self.commits}, "
                f"objects=[{names}])")

    @property
    def built_generation(self) -> int | None:
        """The group generation its model is sharded over (``None``: none yet)."""
        return self._shards.built

    def adopt(self, model: torch.nn.Module, optimizer: Any) -> None:
        """Take ``model``, sharded over this generation's mesh by its owner (a framework
        hook: Lightning's ``configure_model``), and ``optimizer`` as this generation's
        instead of building them; the next ``sync()`` loads the newest commit into them.
        The mesh is ``collective.sharded.fsdp.mesh_for(get_group())``."""
        self._shards.adopt(model, optimizer)

    def full_state_dict(self, optimizer: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers as CPU tensors, on every rank (a
        collective: every rank calls it); keys as ``model.state_dict()``'s. With
        ``optimizer``, also the optimizer's state split with them, under
        ``optimizer.<parameter>.<name>`` (Adam's ``exp_avg``, say)."""
        return self._shards.full_state_dict(optimizer)
