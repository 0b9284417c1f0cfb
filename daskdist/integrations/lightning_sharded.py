"""``DaskdistStrategy``'s path for a LightningModule that shards itself in
``configure_model`` (Lightning's FSDP2 / ModelParallel convention), SPEC §4.5.

Before Lightning calls ``configure_model`` (:func:`prepare`, from the strategy's
``setup_environment``), the module gets ``self.device_mesh``: the generation's mesh over
daskdist's group (``collective.sharded.fsdp.mesh_for``: 1-D ``("data_parallel",)``, or 2-D with
a ``"data_parallel"`` dimension of every rank and a second of one). FSDP2 shards a
module in place and cannot be undone, and Lightning's rule is that ``configure_model``
is idempotent: so the strategy keeps an unsharded copy of the module, taken before its
first ``configure_model`` on this worker, and after a re-formation puts the module back
to it (its class, parameters, submodules and hooks; the trainer and the elastic state
kept) so ``configure_model`` shards a fresh module over the new mesh. A fresh module
starts from rank 0's weights. Then (:func:`begin`, from the strategy's ``setup``) the
fit's one optimizer joins a :class:`~daskdist.collective.ShardedState` kept with the
module, whose ``sync()`` loads the newest commit resharded. Keep the template small by
creating the layers in ``configure_model``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from daskdist.collective.group import Group
from daskdist.collective.replicas import broadcast_parameters
from daskdist.collective.sharded.fsdp import forget_meshes, mesh_for
from daskdist.collective.sharded.state import ShardedState
from daskdist.integrations.common import STATE_ATTR, kept_state, state_for

_UNSHARDED = "_daskdist_unsharded"  # the module as it was before its first sharding
# what a module put back to its unsharded copy keeps of its own
_KEEP = ("_trainer", "_fabric", "_device_mesh", STATE_ATTR, _UNSHARDED)


def sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds FSDP2-sharded submodules (itself included)."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def prepare(module: Any, g: Group, dims: tuple[str, ...]) -> None:
    """Before ``configure_model`` of a fit on generation ``g``: the module unsharded
    unless already sharded over ``g``'s mesh (a later fit of the same generation), and
    its ``device_mesh``."""
    forget_meshes()
    state = kept_state(module)
    built = state.built_generation if isinstance(state, ShardedState) else None
    template = module.__dict__.get(_UNSHARDED)
    if template is None:
        if sharded(module):
            raise ValueError(
                f"DaskdistStrategy: {type(module).__name__} was sharded before its first "
                f"fit here; shard it in configure_model (over self.device_mesh), so every "
                f"generation of the group shards it afresh")
        module.__dict__[_UNSHARDED] = copy.deepcopy(module)  # its trainer left out
        fresh = True
    else:
        fresh = sharded(module) and built != g.generation
        if fresh:
            _put_back(module, template)
    if fresh and g.world_size > 1:
        broadcast_parameters(module, src=0, group=g)  # a fresh start is rank 0's
    module._device_mesh = mesh_for(g, dims)


def _put_back(module: Any, template: Any) -> None:
    """``module`` as ``template`` was (a copy of it), keeping its own trainer, mesh and
    elastic state: ``configure_model`` shards it again."""
    from torch.distributed._composable_state import _module_state_mapping

    fresh = copy.deepcopy(template)
    keep = {k: module.__dict__[k] for k in _KEEP if k in module.__dict__}
    _module_state_mapping.pop(module, None)  # FSDP2's record of the old sharding
    module.__dict__.clear()
    module.__dict__.update(fresh.__dict__)
    module.__dict__.update(keep)
    module.__class__ = type(fresh)


def begin(module: Any, trainer: Any, make: Any) -> ShardedState:
    """The fit's ShardedState (made by ``make`` the first time, kept with the module),
    with the sharded module and the fit's optimizer adopted, synced to the newest
    commit; the LR schedulers take their committed state."""
    if len(trainer.optimizers) != 1:
        raise ValueError(f"DaskdistStrategy: a module sharded in configure_model trains "
                         f"with one optimizer, got {len(trainer.optimizers)}")
    state = state_for(module, "lightning", make)
    if not isinstance(state, ShardedState):
        raise TypeError("DaskdistStrategy: this module was trained unsharded (DDP) here "
                        "before; a module shards in configure_model from its first fit on")
    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
    state.adopt(module, trainer.optimizers[0])
    state.sync()
    for sched, sd in zip(schedulers, state.schedulers or [], strict=False):
        sched.load_state_dict(sd)
    return state


def new_state(module: Any, checkpoint_to: str | None, every: int) -> ShardedState:
    """A ShardedState for a module sharded by Lightning's ``configure_model`` (adopted
    at each fit: it builds nothing itself)."""
    def built_elsewhere() -> Any:
        raise RuntimeError("DaskdistStrategy adopts the module configure_model sharded")

    state = ShardedState(model=built_elsewhere, loops=None, global_step=0, schedulers=None)
    if checkpoint_to is not None:
        state.checkpoint_to(checkpoint_to, every)
    return state
