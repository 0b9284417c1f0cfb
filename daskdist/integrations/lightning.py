"""``DaskdistStrategy``: Lightning's ``Trainer.fit`` on every gang member, over daskdist's
group, elastic and exactly once (SPEC §4.4).

Ray Train's thin pattern: the process group already exists (daskdist formed it), so
nothing is initialized, no port is opened and no environment variable is set; ranks and
world size come from :func:`daskdist.collective.get_group` (:class:`DaskdistEnvironment`,
whose setters and teardown do nothing), the device from the worker; the data is already
per worker (``dd.collective.synced(it)``), so no ``DistributedSampler`` splits it again.

What the strategy adds to DDP:

- DDP runs on the group's process group, its gradient buckets averaged through
  daskdist's :meth:`Group.allreduce` (a lost peer wakes it at once); Lightning's
  barrier, broadcast and reductions go through the group too. A peer lost inside any
  of the fit's collective calls ends ``fit`` with ``CollectiveError`` (the launcher,
  :class:`_Launcher`, turns torch's errors into it), so the gang runs again.
- The training state (module weights, optimizers and LR schedulers, Lightning's loop
  progress, so ``global_step``) lives in a ``dd.collective.State`` kept with the module
  (a per-worker resource), committed every ``commit_every`` optimizer steps and at the
  end of the data. A member lost, or a worker joining or leaving, raises
  ``HostsUpdatedInterrupt`` at a commit; the gang runs ``fit`` again and the new fit
  starts from the newest commit (``State.sync()`` in :meth:`DaskdistStrategy.setup`).
- Under a ``"dynamic"`` dataset the commits acknowledge the rows of the steps they hold,
  never those of the batch Lightning fetched ahead (:class:`~.common.TokenHold`).
- A SIGTERM notice (daskdist's, see ``plugins/worker/preemption.py``; Lightning's own
  handler is installed on the main thread only, and fit runs in a worker thread) is a
  leave at the next commit, like a retirement.
- A module that shards itself in ``configure_model`` (FSDP2's ``fully_shard`` over
  ``self.device_mesh``, Lightning's ModelParallel convention) is not wrapped in DDP: its
  state is a ``dd.collective.ShardedState`` (commits that survive a loss in memory,
  resharded resume), and after a re-formation ``configure_model`` gets a fresh unsharded
  module to shard over the new mesh (``integrations/lightning_sharded.py``).

Threads: everything here runs in the gang closure's thread.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher as _LightningLauncher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.nn.parallel import DistributedDataParallel

from daskdist.collective.group import Group, get_group
from daskdist.collective.state.elastic import State
from daskdist.integrations.common import (
    GroupHook,
    Optimizers,
    TokenHold,
    disarm,
    failures,
    state_for,
)

__all__ = ["DaskdistEnvironment", "DaskdistStrategy"]


class DaskdistEnvironment(ClusterEnvironment):
    """Ranks and world size of daskdist's formed group; nothing to launch or set."""

    @property
    def creates_processes_externally(self) -> bool:
        return True  # the gang runs on every member already: Lightning spawns nothing

    @property
    def main_address(self) -> str:
        return ""  # never used: the process group exists before fit

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False  # chosen explicitly, by DaskdistStrategy

    def world_size(self) -> int:
        return get_group().world_size

    def set_world_size(self, size: int) -> None:
        pass  # the group's

    def global_rank(self) -> int:
        return get_group().rank

    def set_global_rank(self, rank: int) -> None:
        pass  # the group's

    def local_rank(self) -> int:
        return 0  # one device per worker (its own GPU, or the CPU)

    def node_rank(self) -> int:
        return get_group().rank

    def teardown(self) -> None:
        pass  # nothing was set


class DaskdistStrategy(DDPStrategy):
    """Lightning DDP on daskdist's group, elastic and exactly once (see the module).

    ``commit_every``: optimizer steps between commits (a leave or a join waits for the
    next one). ``checkpoint_to``, ``every``: ``State.checkpoint_to(url, every)`` (durable
    commits, resume on a new cluster). ``device_mesh``: the names of the mesh a module
    that shards itself in ``configure_model`` gets as ``self.device_mesh``:
    ``("data_parallel",)`` (1-D over the group) or ``("data_parallel", name)`` (2-D,
    the second dimension of size one). Other keyword arguments go to
    ``DistributedDataParallel`` (``find_unused_parameters``, ``static_graph``, ...).
    Create it inside the gang closure, one per ``Trainer``.
    """

    strategy_name = "daskdist"

    def __init__(self, commit_every: int = 1, checkpoint_to: str | None = None,
                 every: int = 100, device_mesh: tuple[str, ...] = ("data_parallel",),
                 **ddp_kwargs: Any):
        if not isinstance(commit_every, int) or commit_every < 1:
            raise ValueError(f"commit_every must be an int >= 1, got {commit_every!r}")
        dims = tuple(device_mesh) if isinstance(device_mesh, (tuple, list)) else ()
        if not (1 <= len(dims) <= 2 and dims[0] == "data_parallel"
                and all(isinstance(d, str) for d in dims) and len(set(dims)) == len(dims)):
            raise ValueError(f"device_mesh must be ('data_parallel',) or ('data_parallel', "
                             f"<another name>), got {device_mesh!r}")
        if checkpoint_to is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        for bad in ("process_group", "device_ids"):
            if bad in ddp_kwargs:
                raise ValueError(f"DaskdistStrategy sets DDP's {bad} itself (from the group)")
        super().__init__(cluster_environment=DaskdistEnvironment(), **ddp_kwargs)
        self.commit_every = commit_every
        self.checkpoint_to = checkpoint_to
        self.every = every
        self.device_mesh_dims = dims
        self._fit: _ElasticFit | None = None

    # -- where ranks and the device come from ------------------------------------------

    @property
    def root_device(self) -> torch.device:
        return torch.device(get_group().device)

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return [self.root_device]

    @parallel_devices.setter
    def parallel_devices(self, devices: Any) -> None:
        pass  # the worker's device, not the accelerator's list of visible ones

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the data is per worker already: a DistributedSampler Lightning adds to a
        # DataLoader keeps every sample of it
        return {"num_replicas": 1, "rank": 0}

    def _configure_launcher(self) -> None:
        self._launcher = _Launcher(self)

    def setup_distributed(self) -> None:
        """The group exists: no ``init_process_group``, no port, no environment variable."""
        g = get_group()
        self.set_world_ranks()
        self._process_group_backend = g.backend
        self._timeout = timedelta(seconds=g.timeout)

    def setup_environment(self) -> None:
        """The group, then for a module with ``configure_model``: its ``device_mesh``,
        and the module unsharded again after a re-formation (``lightning_sharded``)."""
        super().setup_environment()
        module = self.lightning_module
        if module is not None and is_overridden("configure_model", module):
            from daskdist.integrations.lightning_sharded import prepare

            prepare(module, get_group(), self.device_mesh_dims)

    # -- DDP on the group ---------------------------------------------------------------

    def _setup_model(self, model: torch.nn.Module) -> Any:
        g = get_group()
        if _is_sharded(model):
            return model  # FSDP2 reduces its own gradients (on the group's process group)
        device_ids = self.determine_ddp_device_ids()
        ddp = DistributedDataParallel(module=model, device_ids=device_ids,
                                      process_group=g.process_group, **self._ddp_kwargs)
        if self._fit is not None:
            self._fit.hook = GroupHook(g)
            self._fit.hook.install(ddp)
        return ddp

    def _register_ddp_hooks(self) -> None:
        pass  # ours is installed in _setup_model; a user's ddp_comm_hook is not supported

    def setup(self, trainer: Any) -> None:
        self._fit = _ElasticFit(self, trainer)
        super().setup(trainer)  # DDP (with the group's hook), optimizers, precision
        if trainer.state.fn == TrainerFn.FITTING:
            self._fit.begin()

    def process_dataloader(self, dataloader: object) -> object:
        if self._fit is not None and self._fit.trainer.state.stage == RunningStage.TRAINING:
            return self._fit.hold.wrap(dataloader)
        return dataloader

    def teardown(self) -> None:
        fit, self._fit = self._fit, None
        try:
            disarm(self.model)  # before DDP is unwrapped: the module outlives this fit
            if fit is not None:
                fit.release()
        finally:
            super().teardown()

    # -- Lightning's own collective calls, through the group ----------------------------

    def barrier(self, name: str | None = None) -> None:
        get_group().barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return get_group().broadcast_object(obj, src=src)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return _reduce(get_group(), tensor, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None,
                   sync_grads: bool = False) -> torch.Tensor:
        if sync_grads:  # autograd through the gather: torch's own (on the same group)
            return super().all_gather(tensor, group=group, sync_grads=True)
        g = get_group()
        wire = g.wire_device
        parts = g.allgather(tensor.detach().contiguous().to(wire))
        return torch.stack(parts).to(tensor.device)


_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def _reduce(g: Group, tensor: torch.Tensor, reduce_op: Any) -> torch.Tensor:
    name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower().split(".")[-1]
    op = _OPS.get(name)
    if op is None:
        raise ValueError(f"DaskdistStrategy.reduce: unsupported reduce_op {reduce_op!r}; "
                         f"expected one of {sorted(_OPS)}")
    t = tensor.detach().contiguous().to(g.wire_device)
    if not t.is_floating_point() and op == "mean":
        t = t.double()
    t = t.clone()
    g.allreduce(t, op=op)
    return t.to(tensor.device)


class _Launcher(_LightningLauncher):
    """Launches nothing (the gang runs on every member); runs fit with a peer's loss in
    any collective call of it turned into ``CollectiveError``."""

    def __init__(self, strategy: DaskdistStrategy):
        self.strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        with failures(get_group(), self._hook):
            return function(*args, **kwargs)

    def _hook(self) -> GroupHook | None:
        fit = self.strategy._fit  # the exception passes here before fit's teardown
        return None if fit is None else fit.hook

    def kill(self, signum: Any) -> None:
        pass  # no process of ours to kill


class _ElasticFit:
    """One fit's elastic state: the module's ``State``, the commit schedule, the tokens of
    batches fetched ahead. Lives from the strategy's ``setup`` to its ``teardown``."""

    def __init__(self, strategy: DaskdistStrategy, trainer: Any):
        self.strategy = strategy
        self.trainer = trainer
        self.hold = TokenHold()
        self.hook: GroupHook | None = None
        self.state: State | None = None
        self.committed_step = -1  # global_step of the last commit
        self.last_step = -1  # global_step at the last batch's end
        self.loops: dict | None = None  # the fit loop's progress at the last step's end
        self.callback = _CommitCallback(self)

    def begin(self) -> None:
        """After DDP and the optimizers are set up: take the newest commit on every rank
        (weights, optimizers, schedulers, loop progress), then fit goes on from it."""
        trainer = self.trainer
        module = self.strategy.lightning_module
        s = self.strategy
        if _is_sharded(module):
            from daskdist.integrations import lightning_sharded

            self.state = lightning_sharded.begin(module, trainer, lambda: (
                lightning_sharded.new_state(module, s.checkpoint_to, s.every)))
            self._resume(self.state)
            return
        state = state_for(module, "lightning", lambda: _new_state(module, s))
        state.optimizer = Optimizers(trainer.optimizers,
                                     [c.scheduler for c in trainer.lr_scheduler_configs])
        # a re-formation's reset callbacks (State.register_reset_callbacks) run in sync();
        # the strategy needs none: every fit after a re-formation is a fresh Trainer
        state.sync()
        self.state = state
        self._resume(state)

    def _resume(self, state: State) -> None:
        """The loop progress of the commit ``state`` synced to; the commit schedule."""
        trainer = self.trainer
        if state.loops is not None:
            trainer.fit_loop.load_state_dict(copy.deepcopy(state.loops))
        self.committed_step = self.last_step = trainer.global_step
        if self.callback not in trainer.callbacks:
            trainer.callbacks.append(self.callback)

    def step_ended(self) -> None:
        """End of a training batch: keep the loop progress; commit when due."""
        trainer = self.trainer
        step = trainer.global_step
        if step == self.last_step:
            return  # no optimizer step (gradient accumulation)
        self.last_step = step
        self.loops = _resumable(trainer.fit_loop.state_dict())
        if step % self.strategy.commit_every == 0:
            self.commit(step)

    def data_ended(self) -> None:
        """End of the epoch (the per-worker data ran out on every rank at once): commit
        the steps since the last commit, with the loop progress of the last step (an
        epoch that ends here goes on in the next fit if rows come back)."""
        step = self.trainer.global_step
        if self.loops is not None and step != self.committed_step:
            self.commit(step)

    def commit(self, step: int) -> None:
        state = self.state
        assert state is not None
        state.loops = self.loops
        state.global_step = step
        if hasattr(state, "schedulers"):  # a ShardedState: their state rides as objects
            state.schedulers = [c.scheduler.state_dict()
                                for c in self.trainer.lr_scheduler_configs]
        self.committed_step = step
        state.commit()  # HostsUpdatedInterrupt ends fit here; the gang runs it again

    def release(self) -> None:
        """Fit ended: rows of batches fetched and never trained go back."""
        self.hold.release()
        if self.callback in self.trainer.callbacks:
            self.trainer.callbacks.remove(self.callback)


def _new_state(module: Any, s: DaskdistStrategy) -> State:
    state = State(model=module, optimizer=Optimizers(), loops=None, global_step=0)
    if s.checkpoint_to is not None:
        state.checkpoint_to(s.checkpoint_to, s.every)
    return state


def _resumable(loops: dict) -> dict:
    """The fit loop's progress as a commit keeps it: never "at the last batch" (the data
    of a later fit continues the epoch; Lightning would count it as ended)."""
    bp = loops.get("epoch_loop.batch_progress")
    if isinstance(bp, dict) and bp.get("is_last_batch"):
        bp["is_last_batch"] = False
    return loops


class _CommitCallback(Callback):
    """The strategy's hooks in the fit loop (added to the trainer's callbacks while a fit
    runs): a batch starts (its rows become the commit's), a step ends (commit when
    due), the data ends (commit the rest)."""

    def __init__(self, fit: _ElasticFit):
        self.fit = fit

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self.fit.hold.started()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.fit.step_ended()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.fit.data_ended()


def _is_sharded(module: Any) -> bool:
    """Whether ``module`` sharded itself with FSDP2 (in ``configure_model``)."""
    from daskdist.integrations.lightning_sharded import sharded

    return sharded(module)
