"""Elastic training state with Horovod semantics (SPEC §4).

``State(model, optimizer, **objects)`` keeps a committed copy of the training state:

- ``commit()`` saves a copy, then checks for host updates: rank 0's view of the
  membership counter (``daskdist.context.membership_version()``, bumped by the
  scheduler plugin on every join or leave) is broadcast, so every rank takes rank
  0's decision and ``HostsUpdatedInterrupt`` is raised on **all** ranks at the same
  commit, never on some ranks only (which would deadlock the next collective).
- ``restore()`` returns model, optimizer and objects to the last commit.
- ``sync()`` broadcasts rank 0's model, optimizer and objects, and records the result
  (and rank 0's membership counter) as the last commit.

The state always talks to the group formed *now* (``get_group()`` per call), so one
``State`` survives a re-formation: catch the error, re-form, ``sync()``, continue.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from daskdist.collective.group import Group, get_group
from daskdist.collective.replicas import broadcast_parameters
from daskdist.context import membership_version
from daskdist.errors import HostsUpdatedInterrupt  # defined there: the worker plugin knows it

_OWN = ("model", "optimizer", "_objects", "_saved", "_last_version")


class State:
    """Model, optimizer and named objects of a training loop, committed and restored.

    Objects are attributes: ``State(model, opt, step=0)`` gives ``state.step``.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **objects: Any,
    ):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_objects", dict(objects))
        object.__setattr__(self, "_saved", None)
        object.__setattr__(self, "_last_version", membership_version())
        self.save()

    # -- objects as attributes ---------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            self._objects[name] = value

    def __repr__(self) -> str:
        names = ", ".join(sorted(self._objects))
        return f"State(model={type(self.model).__name__}, objects=[{names}])"

    # -- Horovod's API -----------------------------------------------------------

    def save(self) -> None:
        """Keep a deep copy of the current state (no communication)."""
        self._saved = (
            _copy_state_dict(self.model),
            _copy_state_dict(self.optimizer),
            copy.deepcopy(self._objects),
        )

    def commit(self) -> None:
        """Save, then raise ``HostsUpdatedInterrupt`` on all ranks if hosts changed."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """One broadcast of rank 0's decision; raises on every rank alike."""
        g = get_group()
        decision = torch.zeros(2, dtype=torch.int64, device=g._wire_device())
        if g.rank == 0:
            now = membership_version()
            decision[0] = int(now != self._last_version)
            decision[1] = now
        g.broadcast(decision, src=0)  # one small call: commit() runs every step
        changed, version = (int(v) for v in decision.tolist())
        self._last_version = version
        if changed:
            raise HostsUpdatedInterrupt(
                f"workers joined or left (membership version {version}); re-form and sync()"
            )

    def restore(self) -> None:
        """Return model, optimizer and objects to the last commit (no communication)."""
        model_sd, opt_sd, objects = self._saved
        if self.model is not None and model_sd is not None:
            self.model.load_state_dict(model_sd)
        if self.optimizer is not None and opt_sd is not None:
            self.optimizer.load_state_dict(copy.deepcopy(opt_sd))
        self._objects.clear()
        self._objects.update(copy.deepcopy(objects))

    def sync(self, group: Group | None = None) -> None:
        """Make every rank equal to rank 0, and record that as the last commit."""
        g = group or get_group()
        if self.model is not None:
            broadcast_parameters(self.model, src=0, group=g)
        payload = None
        if g.rank == 0:
            opt_sd = None
            if self.optimizer is not None:
                opt_sd = _to_cpu(self.optimizer.state_dict())
            payload = (opt_sd, self._objects, membership_version())
        opt_sd, objects, version = g.broadcast_object(payload, src=0)
        if g.rank != 0:
            if self.optimizer is not None and opt_sd is not None:
                self.optimizer.load_state_dict(opt_sd)
            self._objects.clear()
            self._objects.update(objects)
        self._last_version = version
        self.save()


def _copy_state_dict(obj: Any) -> Any:
    if obj is None:
        return None
    return copy.deepcopy(obj.state_dict())


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor moved to the CPU (for pickling across devices)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
