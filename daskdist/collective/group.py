"""``get_group()`` and the collective calls a closure makes on its group (SPEC §4).

Every call is issued asynchronously and waited on until the work ends, a peer is
declared lost (``mark_peer_lost``: the scheduler plugin says a peer left), the group is
torn down, or the group's ``timeout`` passes: gloo calls block in torch's own wait in
short slices, checking between them; NCCL calls wait on an event that the work's
future, the lost mark and teardown all set. So a call ends as soon as either the
transport or the scheduler knows a peer is gone, and never later than the timeout.
Every torch error (gloo raises plain ``RuntimeError``) becomes ``CollectiveError``,
and after one failure the group refuses further calls at once: its members are
out of step and it must be re-formed.

Tensor ops work in place, like torch.distributed. Objects travel as pickled
bytes: their size first, then the bytes (Horovod's ``broadcast_object``).
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from daskdist.collective.bootstrap import PROCESS, ProcessMembership
from daskdist.errors import CollectiveError
from daskdist.observe import phases

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # then divided by world_size (gloo has no AVG)
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

# Extra seconds past the group's timeout before we stop waiting ourselves, so the
# transport's own (more precise) timeout error normally arrives first.
_GRACE = 2.0
# How long a gloo call blocks inside torch at a time: a lost peer or teardown is
# noticed within one slice; a timed-out slice costs one exception from torch.
_SLICE = datetime.timedelta(milliseconds=10)


def get_group() -> Group:
    """The collective group this worker is a member of (call it inside a closure).

    Raises ``RuntimeError`` when no group is formed in this process.
    """
    m = PROCESS.current()
    if m is None:
        raise RuntimeError(
            "no collective group is formed on this worker: create one with "
            "coord.collective_group() and call get_group() inside a closure on a member"
        )
    return Group(m)


class Group:
    """One generation of the group, as seen by this member.

    A ``Group`` stays bound to its generation: once that generation is lost or
    replaced, its calls raise ``CollectiveError``; call ``get_group()`` again on the
    re-formed group.
    """

    def __init__(self, member: ProcessMembership):
        self.rank: int = member.rank
        self.world_size: int = member.world_size
        self.generation: int = member.generation
        self.backend: str = member.backend
        self.device: torch.device = member.device
        self.timeout: float = member.timeout
        self._pg = member.pg

    @property
    def process_group(self) -> Any:
        """This generation's torch process group, for frameworks that call
        torch.distributed on it themselves (DDP, FSDP2's ``DeviceMesh``); wait for their
        work with :meth:`wait_for` so a lost peer ends it as it ends the group's calls."""
        return self._pg

    @property
    def wire_device(self) -> torch.device:
        """Where this group's backend takes tensors: the group's device under NCCL, else
        the CPU (the small int tensors of heads and flags are made there)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def usable(self) -> bool:
        """Whether this generation can still make calls (no peer lost, not torn down)."""
        try:
            PROCESS.check(self.generation)
        except CollectiveError:
            return False
        return True

    def __repr__(self) -> str:
        return (
            f"Group(rank={self.rank}, world_size={self.world_size}, "
            f"generation={self.generation}, backend={self.backend!r}, device={self.device})"
        )

    # -- tensor collectives ------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks, in place; returns it.

        ``op`` is ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``. For
        integer tensors ``"mean"`` truncates toward zero (as NCCL's average does).
        """
        try:
            rop = _OPS[op.lower()]
        except (KeyError, AttributeError):
            raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_OPS)}") from None
        _check_tensor(tensor, self.backend)
        self._run("allreduce", lambda pg: dist.all_reduce(tensor, op=rop, group=pg, async_op=True))
        if op.lower() == "mean" and self.world_size > 1:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(self.world_size)
            else:
                tensor.div_(self.world_size, rounding_mode="trunc")
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s, in place; returns it."""
        _check_tensor(tensor, self.backend)
        self._check_rank(src)
        self._run("broadcast", lambda pg: dist.broadcast(tensor, src=src, group=pg, async_op=True))
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype everywhere), in rank order."""
        _check_tensor(tensor, self.backend)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("allgather", lambda pg: dist.all_gather(out, tensor, group=pg, async_op=True))
        return out

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int],
                          input_split_sizes: list[int]) -> torch.Tensor:
        """Send ``input_split_sizes[r]`` elements of ``input`` (in rank order) to each rank
        r and receive ``output_split_sizes[r]`` from each into ``output``; returns it.
        The sizes must agree between each pair of ranks (zeros are allowed)."""
        _check_tensor(output, self.backend)
        _check_tensor(input, self.backend)
        for name, sizes, t in (("output", output_split_sizes, output),
                               ("input", input_split_sizes, input)):
            if len(sizes) != self.world_size or sum(sizes) != t.numel():
                raise ValueError(f"all_to_all_single: {name}_split_sizes {list(sizes)} do "
                                 f"not split {t.numel()} elements over {self.world_size} ranks")
        self._run("all_to_all", lambda pg: dist.all_to_all_single(
            output, input, list(output_split_sizes), list(input_split_sizes), group=pg,
            async_op=True))
        return output

    def barrier(self) -> None:
        """Return once every rank reached this barrier."""
        t = torch.zeros(1, device=self.wire_device)
        self._run("barrier", lambda pg: dist.all_reduce(t, group=pg, async_op=True))

    # -- object collectives ------------------------------------------------------

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (other ranks' ``obj`` is ignored).

        If ``obj`` cannot be pickled on ``src``, every rank raises (``src`` the
        pickling error, the others ``CollectiveError``), rather than the others
        waiting for bytes that never come.
        """
        self._check_rank(src)
        dev = self.wire_device
        failure: BaseException | None = None
        if self.rank == src:
            try:
                payload = _to_bytes(obj, dev)
            except Exception as e:
                failure, payload = e, torch.empty(0, dtype=torch.uint8, device=dev)
            n = -1 if failure is not None else payload.numel()
            size = torch.tensor([n], dtype=torch.int64, device=dev)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=dev)
        self.broadcast(size, src)
        n = int(size.item())
        if n < 0:
            if failure is not None:
                raise failure
            raise CollectiveError(f"broadcast_object: rank {src} could not pickle its object")
        if self.rank != src:
            payload = torch.empty(n, dtype=torch.uint8, device=dev)
        self.broadcast(payload, src)
        if self.rank == src:
            return obj
        return _from_bytes(payload)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (all ranks raise if one cannot pickle)."""
        dev = self.wire_device
        failure: BaseException | None = None
        try:
            payload = _to_bytes(obj, dev)
        except Exception as e:
            failure, payload = e, torch.empty(0, dtype=torch.uint8, device=dev)
        n_mine = -1 if failure is not None else payload.numel()
        sizes = self.allgather(torch.tensor([n_mine], dtype=torch.int64, device=dev))
        n = [int(s.item()) for s in sizes]
        if min(n) < 0:
            if failure is not None:
                raise failure
            bad = [r for r, k in enumerate(n) if k < 0]
            raise CollectiveError(f"allgather_object: ranks {bad} could not pickle their objects")
        padded = torch.zeros(max(n), dtype=torch.uint8, device=dev)
        padded[: payload.numel()] = payload
        parts = self.allgather(padded)
        out = [_from_bytes(p[:k]) for p, k in zip(parts, n, strict=True)]
        out[self.rank] = obj
        return out

    # -- pickling: a Group names a generation; its process group stays local -----

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pg"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        m = PROCESS.current()
        if m is not None and m.generation == self.generation:
            self._pg = m.pg

    # -- machinery ---------------------------------------------------------------


    def _check_rank(self, src: int) -> None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"src {src} outside [0, {self.world_size})")

    @phases.timed(phases.COLLECTIVE)  # a gang member's collective phase (SPEC §5.1)
    def _run(self, what: str, issue: Callable[[Any], Any]) -> None:
        """Issue one async collective and wait for it, the lost signal, or the timeout."""
        gen = self.generation
        PROCESS.check(gen)
        # Always this generation's own process group, never "the current default":
        # a call racing a re-formation must not land in the next generation's group.
        pg = self._pg
        try:
            work = issue(pg)
        except Exception as e:
            PROCESS.break_group(gen, f"{what} failed: {e}")
            raise CollectiveError(f"{what} failed on rank {self.rank}: {e}") from e
        self.wait_for(work, what)

    def wait_for(self, work: Any, what: str) -> None:
        """Wait for ``work``, a collective issued on this generation's process group (by
        this group, or by a framework calling torch.distributed on it: FSDP2), as the
        group's own calls wait: until it ends, a peer is declared lost, the group is torn
        down or its timeout passes; every failure is ``CollectiveError`` and breaks the
        group. NCCL work is waited on the CPU too (its future)."""
        gen, pg = self.generation, self._pg
        start = time.monotonic()
        if self.backend == "gloo":
            self._wait_in_torch(work, pg, gen, what)
        else:
            self._wait_on_future(work, pg, gen, what)
        try:
            work.wait()
        except Exception as e:
            PROCESS.break_group(gen, f"{what} failed: {e}")
            # the transport's own timeout: which ranks were stuck where
            stuck = phases.stuck() if time.monotonic() - start >= self.timeout else ""
            raise CollectiveError(f"{what} failed on rank {self.rank}: {e}{stuck}") from e

    def _wait_in_torch(self, work: Any, pg: Any, gen: int, what: str) -> None:
        """Gloo: block inside torch's own wait, ``_SLICE`` at a time, until ``work`` ended.

        The thread sleeps with the GIL released and wakes straight from the transport:
        no callback and no thread hand-off on the way back. Between slices it checks
        for a lost peer, teardown and the deadline (see :meth:`_left`).
        """
        try:
            work.wait(_SLICE)  # most calls end within the first slice
            return
        except Exception:
            if work.is_completed():
                return  # it failed: the caller's wait raises the outcome
        with PROCESS.waiting():  # registered: teardown and mark_peer_lost see a waiting call
            deadline = time.monotonic() + self.timeout + _GRACE
            while True:
                left = self._left(work, pg, gen, what, deadline)
                try:
                    work.wait(min(_SLICE, datetime.timedelta(seconds=left)))
                    return
                except Exception:
                    if work.is_completed():
                        return

    def _wait_on_future(self, work: Any, pg: Any, gen: int, what: str) -> None:
        """NCCL: wait on the work's future (``wait()`` only orders CUDA streams).

        The future's callback sets an event that ``mark_peer_lost`` and teardown set too.
        """
        with PROCESS.waiting() as wake:
            # The future completes a moment before ``work.is_completed()`` turns true:
            # wait on the future, never on the flag.
            fut = work.get_future()
            fut.add_done_callback(lambda _f: wake.set())
            deadline = time.monotonic() + self.timeout + _GRACE
            while not fut.done():
                wake.wait(self._left(work, pg, gen, what, deadline))
                wake.clear()

    def _left(self, work: Any, pg: Any, gen: int, what: str, deadline: float) -> float:
        """Seconds left to wait for ``work``; ``CollectiveError`` (burying the unfinished
        work) when the generation was lost or torn down, or the deadline passed."""
        try:
            PROCESS.check(gen)
        except CollectiveError:
            PROCESS.bury(pg, work)
            raise
        left = deadline - time.monotonic()
        if left <= 0:
            PROCESS.bury(pg, work)
            reason = f"{what} timed out after {self.timeout:g} s"
            PROCESS.break_group(gen, reason)
            # which ranks were stuck where: the scheduler asks every member's stack
            raise CollectiveError(f"{reason} on rank {self.rank}{phases.stuck()}")
        return left


def _check_tensor(t: Any, backend: str = "gloo") -> None:
    """A caller's mistake is a ``TypeError``/``ValueError`` (a user error: the gang fails
    at once), never a transport failure that would re-run the gang on a re-formed
    group only to meet it again."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if backend == "nccl" and t.device.type != "cuda":
        raise ValueError(f"NCCL collectives take CUDA tensors, got one on {t.device}: "
                         f"move it to get_group().device first")
    if not t.is_contiguous():
        # Checked here: torch's own complaint would come as a RuntimeError and break
        # the group for what is a caller's mistake.
        raise ValueError("collective tensors must be contiguous (call .contiguous() first)")


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _from_bytes(t: torch.Tensor) -> Any:
    return pickle.loads(t.cpu().numpy().tobytes())
