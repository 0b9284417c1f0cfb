"""ReplicaKeeper: what a replicated State keeps, the whole state on every rank, and how
``sync()`` makes every rank equal to the newest commit.

Host bytes per rank: one :class:`~daskdist.collective.state.snapshot.HostCopy` of the
model's and the optimizer's state and the objects (the committed copy, refilled in
place), plus a second one only while a commit is in flight (a ``"dynamic"`` dataset's
commit: its outcome comes at the next commit, and until then the committed copy is the
one ``restore()`` goes back to). Once no commit is in flight the second copy goes.
"""

from __future__ import annotations

from typing import Any

from daskdist.collective.group import Group
from daskdist.collective.replicas import broadcast_parameters, to_cpu
from daskdist.collective.state.heads import SyncHead
from daskdist.collective.state.keeper import CHECKPOINT, FRESH, HELD, LOST, SAME, Origin, Subject
from daskdist.collective.state.snapshot import HostCopy, cloned, like


class ReplicaKeeper:
    """The committed copy of a replicated State, and the candidate of a commit in flight
    (see the module). Owned by the State's thread."""

    rides = True

    def __init__(self, subject: Subject) -> None:
        self.subject = subject
        self.saved = HostCopy()  # the committed copy, in host memory
        # the buffers of the copy a confirmed commit replaced: the next candidate's, in
        # the same commit; dropped once no commit is in flight
        self.spare: HostCopy | None = None

    def live(self) -> tuple:
        """Model and optimizer state dicts and objects as they are now (references)."""
        s = self.subject
        return (None if s.model is None else s.model.state_dict(),
                None if s.optimizer is None else s.optimizer.state_dict(), s.objects)

    # -- commits ---------------------------------------------------------------------
    def capture(self, g: Group) -> None:
        """Nothing before the commit: its copy reads the state when it is made."""

    def announce(self, g: Group) -> None:
        return None

    def stage(self, g: Group, told: list[list[int]] | None) -> None:
        """Nothing travels: every rank holds the whole state."""

    def abandon(self, g: Group) -> None:
        """Nothing was staged."""

    def candidate(self) -> HostCopy:
        spare, self.spare = self.spare, None
        return (spare or HostCopy()).fill(self.live())

    def refill(self) -> HostCopy:
        return self.saved.fill(self.live())

    def promote(self, copy: HostCopy) -> None:
        if copy is not self.saved:  # a commit in flight confirmed: swap the buffers
            self.spare, self.saved = self.saved, copy

    def idle(self) -> None:
        self.spare = None

    def save(self) -> None:
        """One copy, in host memory, refilled in place; from CUDA asynchronously."""
        self.saved.fill(self.live())

    def nbytes(self, in_flight: Any) -> int:
        return sum(c.nbytes for c in (self.saved, self.spare, in_flight)
                   if isinstance(c, HostCopy))

    def load(self) -> None:
        """Back to the committed copy: the model copies out of the host buffers; the
        optimizer and the objects, which keep what they are given, get fresh tensors on
        the devices they had."""
        saved, s = self.saved, self.subject
        if saved.skeleton is None:
            return
        model_sd, _, _ = saved.value()
        _, opt_sd, objects = saved.value(to_devices=True)
        if s.model is not None and model_sd is not None:
            s.model.load_state_dict(model_sd)
        if s.optimizer is not None and opt_sd is not None:
            s.optimizer.load_state_dict(opt_sd)
        s.replace_objects(objects)

    # -- sync ------------------------------------------------------------------------
    def rewind(self, synced: bool, renewed: bool) -> None:
        if synced:
            self.load()

    def report(self, g: Group, commits: int) -> list[int]:
        return []  # the commits in the State's head say it all

    def choose(self, g: Group, heads: list[SyncHead], parts: list[list[int]]) -> Origin:
        """The rank holding the most commits (ties: the lowest), never a fresh
        replacement's; the newest checkpoint when it is newer (read by rank 0). Nothing
        moves when every rank holds the same commit and none is a newcomer: all were
        interrupted with skip_sync, or all come from one generation with the same
        commits (the survivors of a member's loss: they committed in lockstep)."""
        counts = [h.commits for h in heads]
        newest = heads[0].newest
        lineage = {h.lineage for h in heads}
        if newest > max(counts):  # no member holds a newer commit: resume from it
            return Origin(CHECKPOINT, newest, 0)
        if max(counts) == 0 and max(h.known for h in heads) > 0:
            return Origin(LOST, 0)
        src = counts.index(max(counts))
        same = (len(set(counts)) == 1 and counts[0] > 0
                and (all(h.skip for h in heads) or (len(lineage) == 1 and -1 not in lineage)))
        if same:
            return Origin(SAME, counts[src], src)
        return Origin(HELD if counts[src] else FRESH, counts[src], src)

    def take(self, g: Group, origin: Origin, durable: Any) -> dict | None:
        """Every rank takes rank ``origin.plan``'s state (a checkpoint: rank 0 reads it
        first); the checkpoint's record on rank 0."""
        record = None
        if origin.kind == CHECKPOINT and g.rank == 0:
            record = self.resume(durable, origin.commits)
        if origin.kind != SAME:
            self.broadcast_from(g, origin.plan)
        return record

    def broadcast_from(self, g: Group, src: int) -> None:
        """Every rank takes rank ``src``'s model, optimizer and objects."""
        s = self.subject
        if s.model is not None:
            broadcast_parameters(s.model, src=src, group=g)
        payload = None
        if g.rank == src:
            opt_sd = None
            if s.optimizer is not None:
                opt_sd = to_cpu(s.optimizer.state_dict())
            payload = (opt_sd, s.objects)
        opt_sd, objects = g.broadcast_object(payload, src=src)
        if g.rank != src:
            if s.optimizer is not None and opt_sd is not None:
                s.optimizer.load_state_dict(opt_sd)
            s.replace_objects(objects)

    def resume(self, durable: Any, commits: int) -> dict:
        """Checkpoint ``commits`` into the model, optimizer and objects; its record."""
        s = self.subject
        model_sd = s.model.state_dict() if s.model is not None else None
        opt_sd, objects, record = durable.load(commits, model_sd)
        if s.optimizer is not None and opt_sd is not None:
            s.optimizer.load_state_dict(opt_sd)
        # read onto the CPU: each object's tensors go back where this State keeps them
        s.replace_objects(like(objects, s.objects))
        return record

    # -- durable checkpoints: rank 0 writes the whole state --------------------------
    def durable(self, url: str, every: int) -> Any:
        from daskdist.collective.state.checkpoint import Durable  # imports fsspec and DCP

        return Durable(url, every)

    def writes_durable(self, rank: int) -> bool:
        return rank == 0

    def write_durable(self, durable: Any, state_id: str, commits: int, services: Any,
                      wait: bool) -> None:
        """The committed copy to the checkpoint store. The write runs in the background
        while later commits refill the buffers, so it gets a copy of its own."""
        model_sd, opt_sd, objects = self.saved.value()
        snapshot = (cloned(model_sd), cloned(opt_sd), cloned(objects))
        durable.write(state_id, commits, snapshot, services, wait=wait)
