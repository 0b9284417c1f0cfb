"""Hugging Face ``transformers.Trainer`` on daskdist's gangs, elastic and exactly once
(SPEC §4.4).

Two ways, one mechanism, inside the gang closure on a ``Trainer`` made there:
``Trainer(model, args, callbacks=[DaskdistCallback(it, commit_every=10)])`` (the way
HF users add callbacks), or ``prepare_trainer(trainer, batches)`` (Ray Train's name and
pattern) on a ``Trainer`` made as usual. Either makes the Trainer a prepared one:

- **The group as its process group.** At each ``train()`` Accelerate's process-wide
  state (``PartialState``, ``AcceleratorState``, ``GradientState``) is reset and set
  from the group (rank, world size, the worker's device; the process group exists, so
  Accelerate initializes nothing), and the Trainer's ``Accelerator`` is made again on
  it: running ``train()`` again on a re-formed group, or a notebook cell again, starts
  clean. DDP's gradient buckets are averaged through daskdist's ``Group.allreduce``,
  and a peer lost in any collective call of ``train()`` raises ``CollectiveError`` (the
  gang runs again).
- **The per-worker batches as its training data.** ``batches`` (the per-worker
  iterator, wrapped in ``dd.collective.synced`` unless it is one already) replaces
  ``get_train_dataloader``: no ``DataLoader`` re-batches them and Accelerate neither
  dispatches nor re-splits them (its ``IterableDatasetShard`` would keep one rank's
  share of each worker's own rows). Set ``max_steps`` (the data has no length: HF's
  rule for streams); training ends when the data does, on every rank.
- **Commits at steps, resume from the newest.** The model's weights, the optimizer and
  LR scheduler and ``global_step`` live in a ``dd.collective.State`` kept with the model
  (a per-worker resource), committed every ``commit_every`` optimizer steps and at the
  end; a re-run ``train()`` starts from the newest commit. Under a ``"dynamic"`` dataset
  the commits acknowledge the rows (every row trained once in the committed model).

A ``TrainerCallback`` alone cannot do this: callbacks are handed neither the Trainer
nor its data loader before it is prepared, nor see the exceptions ``train()`` raises.
So the Trainer's class is changed (:class:`_Prepared`: its data and its ``train()``),
by ``prepare_trainer`` directly, or by the callback at the Trainer's ``on_init_end``,
where it finds the Trainer being made on the call stack (:func:`_constructing_trainer`:
transformers passes callbacks no Trainer, and the Trainer registers itself nowhere).

Threads: everything runs in the gang closure's thread, and nothing writes the process's
environment (other closures' threads read it): Accelerate's state is given the group's
rank and size directly (:func:`_configure_accelerate`), not through torchrun's variables.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback

from daskdist.collective.group import Group, get_group
from daskdist.collective.state.elastic import State
from daskdist.collective.step.synced import synced
from daskdist.integrations.common import GroupHook, Optimizers, disarm, failures, state_for

__all__ = ["DaskdistCallback", "prepare_trainer"]


def prepare_trainer(trainer: Trainer, batches: Iterable, commit_every: int = 1,
                    checkpoint_to: str | None = None, every: int = 100) -> Trainer:
    """Make ``trainer`` train on daskdist's group from ``batches`` (this worker's
    batches: the per-worker iterator, or ``dd.collective.synced(it)``), elastic and
    exactly once; returns it.

    ``commit_every``: optimizer steps between commits. ``checkpoint_to``, ``every``:
    ``State.checkpoint_to(url, every)``. Call it inside the gang closure, on a
    ``Trainer`` made there, with ``TrainingArguments(max_steps=...)``. The same as
    ``Trainer(..., callbacks=[DaskdistCallback(batches, ...)])``.
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"prepare_trainer: expected a transformers.Trainer, got "
                        f"{type(trainer).__name__}")
    callback = DaskdistCallback(batches, commit_every, checkpoint_to, every)
    _attach(trainer, callback)
    trainer.add_callback(callback)
    return trainer


class DaskdistCallback(TrainerCallback):
    """Daskdist's group, data and commits for the ``Trainer`` it is given to (SPEC §4.4):

    ``Trainer(model, args, callbacks=[DaskdistCallback(it, commit_every=10)])``, inside
    the gang closure, with ``TrainingArguments(max_steps=...)``; then ``train()``.
    ``batches``: this worker's batches (the per-worker iterator: it is wrapped in
    ``dd.collective.synced`` unless it is one already). At the Trainer's ``on_init_end``
    the callback takes its Trainer and makes it a prepared one (what
    :func:`prepare_trainer` does: its data, its ``train()``); then ``sync()`` at the
    start of training, a commit every ``commit_every`` optimizer steps and at the end.
    """

    def __init__(self, batches: Iterable, commit_every: int = 1,
                 checkpoint_to: str | None = None, every: int = 100):
        if isinstance(batches, Trainer):
            raise TypeError("DaskdistCallback(batches, ...) takes this worker's batches; "
                            "give it to Trainer(callbacks=[...]), or call "
                            "prepare_trainer(trainer, batches)")
        if not isinstance(commit_every, int) or commit_every < 1:
            raise ValueError(f"commit_every must be an int >= 1, got {commit_every!r}")
        if checkpoint_to is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.batches = _synced(batches)
        self.commit_every = commit_every
        self.checkpoint_to = checkpoint_to
        self.every = every
        self.trainer: Trainer | None = None  # set by _attach
        self.state: State | None = None
        self.hook: GroupHook | None = None
        self.committed_step = -1

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer this callback was given to is made: prepare it."""
        _attach(_constructing_trainer(self), self)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Model wrapped, optimizer and scheduler made: take the newest commit."""
        trainer = self.trainer
        if trainer is None or getattr(trainer, "_daskdist", None) is not self:
            raise RuntimeError(
                "DaskdistCallback was added after the Trainer was made: pass it as "
                "Trainer(..., callbacks=[DaskdistCallback(batches)]), or call "
                "prepare_trainer(trainer, batches)")
        g = get_group()
        wrapped = trainer.model_wrapped
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            self.hook = GroupHook(g)
            self.hook.install(wrapped)
        model = trainer.model
        st = state_for(model, "transformers", lambda: self._new_state(model))
        schedulers = [trainer.lr_scheduler] if trainer.lr_scheduler is not None else []
        st.optimizer = Optimizers([trainer.optimizer], schedulers)
        st.sync()
        state.global_step = int(st.global_step)
        self.state = st
        self.committed_step = state.global_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.commit_every == 0:
            self._commit(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._commit(state.global_step)  # the steps since the last commit (end of data)

    def _commit(self, step: int) -> None:
        if self.state is None or step == self.committed_step:
            return
        self.state.global_step = step
        self.committed_step = step
        self.state.commit()  # HostsUpdatedInterrupt ends train(); the gang runs it again

    def _new_state(self, model: torch.nn.Module) -> State:
        st = State(model=model, optimizer=Optimizers(), global_step=0)
        if self.checkpoint_to is not None:
            st.checkpoint_to(self.checkpoint_to, self.every)
        return st


def _synced(batches: Iterable) -> Iterable:
    """``batches`` as the gang trains them: every rank the same number of steps."""
    if getattr(batches, "gi_code", None) is synced.__code__:
        return batches  # dd.collective.synced(...) already
    return synced(batches)


def _attach(trainer: Trainer, callback: DaskdistCallback) -> None:
    """The one way a Trainer becomes daskdist's (``prepare_trainer`` and the callback's
    ``on_init_end``): checked, given ``callback``, its class made the prepared one."""
    if getattr(trainer, "_daskdist", None) is not None:
        raise ValueError("this Trainer is prepared for daskdist already (one "
                         "DaskdistCallback, or one prepare_trainer call, per Trainer)")
    if callback.trainer is not None:
        raise ValueError("this DaskdistCallback belongs to another Trainer already: make "
                         "one per Trainer")
    if trainer.args.max_steps is None or trainer.args.max_steps <= 0:
        raise ValueError("daskdist: the per-worker batches have no length: set "
                         "TrainingArguments(max_steps=...) (an upper bound: training "
                         "ends when the data does)")
    callback.trainer = trainer
    trainer._daskdist = callback
    trainer.__class__ = _prepared_class(type(trainer))


def _constructing_trainer(callback: DaskdistCallback) -> Trainer:
    """The Trainer whose ``__init__`` is calling ``callback.on_init_end`` now.

    transformers hands callbacks no Trainer (their keyword arguments are the model, the
    optimizer, the scheduler, the tokenizer and the data loaders, and the Trainer
    registers itself on none of them), so this looks up the call stack, a few frames:
    the first ``self`` that is a ``Trainer`` holding ``callback`` (``Trainer.__init__``,
    which calls the callbacks' ``on_init_end`` last)."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            handler = getattr(obj, "callback_handler", None)
            if handler is not None and callback in handler.callbacks:
                return obj
        frame = frame.f_back
    raise RuntimeError("DaskdistCallback.on_init_end: no transformers.Trainer holding this "
                       "callback is being made (give the callback to Trainer(callbacks="
                       "[...]), or call prepare_trainer(trainer, batches))")


class _PerWorkerBatches:
    """The training data of a prepared Trainer: this worker's batches as they come (one
    pass); when they run out, training stops (on every rank at the same step: synced)."""

    def __init__(self, trainer: Trainer, batches: Iterable):
        self.trainer = trainer
        self.batches = batches

    def __iter__(self) -> Iterator:
        yield from self.batches
        self.trainer.control.should_training_stop = True


_CLASSES: dict[type, type] = {}


def _prepared_class(base: type) -> type:
    """``base`` (Trainer or a user's subclass) with daskdist's data and ``train()``."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_Prepared, base), {"__module__": base.__module__})
        _CLASSES[base] = cls
    return cls


class _Prepared:
    """Mixed into a prepared Trainer's class (before the Trainer's own)."""

    _daskdist: DaskdistCallback

    def get_train_dataloader(self) -> Any:
        return _PerWorkerBatches(self, self._daskdist.batches)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        g = get_group()
        _configure_accelerate(g, cpu=bool(getattr(self.args, "use_cpu", False)))
        self.create_accelerator_and_postprocess()  # on the state just set
        disarm(self.model_wrapped)  # a DDP of an earlier train(), maybe another group's
        self.model_wrapped = self.model  # wrapped again, on this group
        try:
            with failures(g, lambda: self._daskdist.hook):
                return super().train(*args, **kwargs)
        finally:
            disarm(self.model_wrapped)  # the model outlives this run (see disarm)


def _configure_accelerate(g: Group, cpu: bool = False) -> None:
    """Reset Accelerate's process-wide state and set it from the group (on the group's
    device, or the CPU where the user's ``TrainingArguments(use_cpu=True)`` says so).

    Accelerate reads a distributed run from torchrun's environment variables
    (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ...) and, on the CPU, writes them back.
    A worker's environment is its process's, read and written by every thread running
    closures there, so it is left alone: Accelerate's state is made as for one process
    (what an environment without those variables gives), then given the group's
    backend, rank and size, and the device, as Accelerate itself takes them from an
    initialized process group (local rank 0: one member per worker process).
    """
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    device = torch.device(g.device)
    if cpu and g.backend == "nccl":
        raise ValueError(
            f"TrainingArguments(use_cpu=True) trains on the CPU, but this worker's group "
            f"is NCCL on {device}, which takes CUDA tensors only: form the group with "
            f"collective_group(backend='gloo'), or leave use_cpu out")
    on_cpu = cpu or device.type == "cpu"
    state = PartialState(cpu=on_cpu)
    state.backend = g.backend
    state.distributed_type = DistributedType.MULTI_CPU if on_cpu else DistributedType.MULTI_GPU
    state.num_processes = g.world_size
    state.process_index = g.rank
    state.local_process_index = 0
    if on_cpu:
        state.device = torch.device("cpu", 0)  # Accelerate's CPU device of local rank 0
    else:
        state.device = device
        torch.cuda.set_device(device)  # this thread's current device, as Accelerate sets it
