"""FSDP2 on daskdist's group: a generation's ``DeviceMesh``, and FSDP2's own collectives
waited as the group's calls are.

FSDP2 issues its all-gathers and reduce-scatters on the mesh's process group directly,
so daskdist's group wrapper never sees them: a peer frozen mid-collective would hold the
survivors for the whole group timeout, and a peer killed mid-collective would surface
as gloo's plain ``RuntimeError`` (a user error to the gang). :func:`guard` gives every
FSDP module of a model custom comms (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``) that issue the same calls (on gloo a reduce-scatter is an
allreduce whose own part is kept: gloo's reduce-scatter cannot be waited for with a
timeout) and wait for them through :meth:`Group.wait_for`: a lost peer
(``mark_peer_lost``) ends them at once with ``CollectiveError``, as it ends the group's
own calls. Under NCCL the wait stays on the
stream (no CPU wait, FSDP2's overlap kept); a lost peer there aborts the communicators
(``mark_peer_lost``) and the next wait raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from daskdist.collective.bootstrap import PROCESS
from daskdist.collective.group import Group
from daskdist.errors import CollectiveError

__all__ = ["forget_meshes", "guard", "mesh_for"]

_meshes: dict[tuple[int, tuple[str, ...]], DeviceMesh] = {}
_meshes_lock = threading.Lock()


def mesh_for(g: Group, dims: Sequence[str] = ("data_parallel",)) -> DeviceMesh:
    """The ``DeviceMesh`` of generation ``g`` (made once per generation, on the group's
    own process group: no second group, no rendezvous). One name: 1-D over every rank.
    Two names: 2-D, every rank along the first, one along the second (``("data_parallel",
    "tensor_parallel")`` for modules written for Lightning's ModelParallelStrategy)."""
    dims = tuple(dims)
    if len(dims) not in (1, 2) or len(set(dims)) != len(dims):
        raise ValueError(f"a mesh has one or two distinct dimension names, got {dims!r}")
    key = (g.generation, dims)
    with _meshes_lock:
        mesh = _meshes.get(key)
        if mesh is not None:
            return mesh
        for k in [k for k in _meshes if k[0] != g.generation]:
            del _meshes[k]  # an older generation's: its process group is gone
    kind = "cuda" if g.backend == "nccl" else "cpu"
    if len(dims) == 1:
        mesh = DeviceMesh.from_group(g.process_group, kind, mesh_dim_names=dims)
    else:
        # each rank alone along the second dimension: a group of one, made by that rank
        # only (no collective call): its name is the same wherever it is made
        solo = dist.new_group([g.rank], use_local_synchronization=True)
        layout = torch.arange(g.world_size, dtype=torch.int).reshape(g.world_size, 1)
        mesh = DeviceMesh.from_group([g.process_group, solo], kind, mesh=layout,
                                     mesh_dim_names=dims)
    with _meshes_lock:
        _meshes[key] = mesh
    return mesh


def forget_meshes() -> None:
    """Clear DTensor's sharding-propagation caches (this thread's and the native one).

    They key on meshes by value, and a generation's mesh equals the previous one of the
    same size while this process's rank in it may differ: an in-place DTensor op of the
    new generation would take an output spec (and its mesh, with the old coordinate)
    cached in the old one. Call it before the first DTensor op of a new generation."""
    from torch.distributed.tensor import DTensor

    # what torch.distributed.tensor.debug._clear_sharding_prop_cache does (that module
    # imports torch._dynamo: seconds)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def guard(model: torch.nn.Module, g: Group) -> int:
    """Route the all-gathers and reduce-scatters of every FSDP module of ``model`` through
    waits that a lost peer of ``g`` ends (see the module); returns how many modules."""
    n = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            try:
                m.set_custom_all_gather(GuardedAllGather(g))
                m.set_custom_reduce_scatter(GuardedReduceScatter(g))
            except ValueError as e:
                raise ValueError(f"ShardedState: {type(m).__name__} cannot have its "
                                 f"collectives guarded: {e}") from e
            n += 1
    return n


class _Alloc:
    """FSDP2's default buffers: plain ``torch.empty``."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class GuardedAllGather(_Alloc, AllGather):
    """FSDP2's all-gather, waited through the group (see the module)."""

    def __init__(self, g: Group) -> None:
        self.g = g

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        work = _issue(self.g, "FSDP all-gather", lambda: dist.all_gather_single(
            output_tensor, input_tensor, group=group, async_op=True))
        if async_op:
            return _GuardedWork(self.g, work, "FSDP all-gather")
        _wait(self.g, work, "FSDP all-gather")
        return None


class GuardedReduceScatter(_Alloc, ReduceScatter):
    """FSDP2's reduce-scatter, waited through the group (see the module)."""

    def __init__(self, g: Group) -> None:
        self.g = g

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> dist.Work | None:
        what, then = "FSDP reduce-scatter", None
        if self.g.backend == "nccl":
            work = _issue(self.g, what, lambda: dist.reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=True))
        else:
            # gloo: an allreduce of the whole input, this rank's part kept. Gloo's own
            # reduce-scatter ignores a wait's timeout (a lost peer would hold it until
            # gloo's timeout, out of the group's reach), and is slower on the CPU
            work = _issue(self.g, what, lambda: dist.all_reduce(
                input_tensor, op=op, group=group, async_op=True))

            def then() -> None:
                mine = input_tensor.view(group.size(), -1)[group.rank()]
                output_tensor.copy_(mine.view_as(output_tensor))
        if async_op:
            return _GuardedWork(self.g, work, what, then)
        _wait(self.g, work, what)
        if then is not None:
            then()
        return None


class _GuardedWork(dist.Work):
    """A collective's work FSDP2 waits on later, waited through the group (``then``: what
    completes it once the wire part ended)."""

    def __init__(self, g: Group, work: Any, what: str,
                 then: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.g, self.work, self.what, self.then = g, work, what, then

    def wait(self, timeout: Any = None) -> bool:
        _wait(self.g, self.work, self.what)
        if self.then is not None:
            self.then, then = None, self.then
            then()
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _issue(g: Group, what: str, call: Callable[[], Any]) -> Any:
    """Issue a collective of generation ``g`` (refused at once when it broke)."""
    PROCESS.check(g.generation)
    try:
        return call()
    except Exception as e:
        PROCESS.break_group(g.generation, f"{what} failed: {e}")
        raise CollectiveError(f"{what} failed on rank {g.rank}: {e}") from e


def _wait(g: Group, work: Any, what: str) -> None:
    if g.backend != "nccl":
        g.wait_for(work, what)
        return
    try:  # NCCL: orders the current stream after the collective; the CPU goes on
        work.wait()
    except Exception as e:
        PROCESS.break_group(g.generation, f"{what} failed: {e}")
        raise CollectiveError(f"{what} failed on rank {g.rank}: {e}") from e
    PROCESS.check(g.generation)  # a peer lost meanwhile: the result is not to be used


def fully_shard_all(model: torch.nn.Module, mesh: Any) -> None:
    """``ShardedState``'s default ``shard``: FSDP2's ``fully_shard(model, mesh=mesh)``."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
