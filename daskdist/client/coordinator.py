"""Coordinator: the client side of daskdist (TensorFlow's ``ClusterCoordinator``).

A thin client over the scheduler plugin's RPC handlers. This file holds its life and
everything but the single closure: registering the plugin and attaching as an owner,
the plumbing to the handlers, gang closures (``schedule_on_all``), the collective
group, per-worker resources and datasets, status, and ``close()``, which ends every
wait at once (SPEC §2.5b). ``schedule`` / ``join`` / ``done`` / ``fetch`` and the
client loop that runs them are ``ClosureClient``'s (``client/closures.py``);
``attach``, ``pending``, ``datasets`` and ``notify_preemption`` are ``JobLife``'s
(``client/lifetime.py``); ``map_batches`` is ``BatchInference``'s (``client/inference.py``).
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
from distributed import Client, get_client
from distributed.diagnostics.plugin import SchedulerPlugin

from daskdist import config
from daskdist.client import reprs
from daskdist.client.closures import (
    ClosureClient,
    GangValues,
    PerWorkerValues,
    RemoteValue,
    ResourceHandle,
)
from daskdist.client.datasets import DistributedDataset, LoaderFactory, PerWorkerDataset
from daskdist.client.group import CollectiveGroup
from daskdist.client.inference import BatchInference
from daskdist.client.lifetime import JobLife
from daskdist.client.notices import NoticeListener
from daskdist.client.report import Report
from daskdist.core import checks
from daskdist.core.protocol import PLUGIN_NAME, DatasetDef, EpochLedger, Outcome, ResourceSpec
from daskdist.errors import CollectiveError
from daskdist.plugins import SCHEDULER_PLUGIN, instantiate


def _has_plugin(dask_scheduler) -> bool:
    return PLUGIN_NAME in dask_scheduler.plugins


class _SchedulerPluginRef(SchedulerPlugin):
    """The scheduler plugin by reference: unpickled on the scheduler it is a
    ``CoordinatorPlugin``; the client never imports the scheduler side."""

    def __reduce__(self) -> tuple:
        return (instantiate, (SCHEDULER_PLUGIN, {}))


class Coordinator(ClosureClient, JobLife, BatchInference):
    """Schedule closures on a Dask cluster's workers, at least once each, surviving worker loss.

    ``Coordinator(client, name="default")`` registers the scheduler plugin (which
    registers the worker plugin on every present and future worker); a second
    Coordinator with the same client and name attaches to the same queue.

    ``max_queued`` bounds unfinished closures (default 256 per worker, at least 256);
    ``max_worker_failures`` is how often a closure's workers may die before it fails
    with ``WorkerLostError``; ``torch_threads`` sets torch's intra-op threads on the
    workers (Dask starts them with ``OMP_NUM_THREADS=1``, which slows gloo reductions
    and CPU training; the first Coordinator of a name decides). ``lease_timeout``
    (default ``daskdist.liveness.lease-timeout``, 30 s) is how long a worker may send
    nothing before its work is taken back (the first Coordinator of a name decides).
    ``resources`` (e.g. ``{"GPU": 1}``) makes only the workers that declare those Dask
    resources (``dask worker --resources GPU=1``) members: closures, gangs, the
    collective group and loaders run there; the other workers stay free for Dask's own
    tasks, such as computing a collection's partitions (the first Coordinator of a name
    decides; another asking for other resources gets a ``ValueError``).
    ``members="gpu"`` makes only the workers with a GPU by the Dask convention members,
    as a stock dask-cuda cluster builds them (no resource declared): a worker whose
    ``CUDA_VISIBLE_DEVICES`` names a device (its first entry, an index, ``GPU-`` UUID or
    ``MIG-`` id, is its GPU), or, with the variable unset, that declares a ``GPU``
    resource or whose host has a GPU; ``CUDA_VISIBLE_DEVICES=""`` is no GPU. The other
    workers (plain ``dask worker``s beside dask-cuda's) are helpers, as with
    ``resources``; with both, a member needs both. :meth:`members` says who is which.

    Each Coordinator is an *owner* of the named queue: its closures, its errors and its
    per-worker resources are its own. ``close()`` (or its client staying away longer
    than ``daskdist.coordinator.client-grace``) ends it: every pending ``RemoteValue``
    resolves at once, its resources are released on every worker, and when no
    Coordinator of the name is left its worker plugin goes too.

    ``keep_alive=True``: its work outlives its client (SPEC §4.6). When the client
    disconnects (a kernel restart), its closures, gangs and datasets go on and their
    values wait on the scheduler, each until it is read (bounded by
    ``daskdist.coordinator.keep-results``: beyond, with no client its queued closures
    wait), for ``daskdist.coordinator.keep-alive-timeout`` (24 h);
    ``Coordinator.attach(client, name)`` from any client of the scheduler takes it over,
    and ``pending()`` gives what it had not read.
    """

    def __init__(
        self,
        client: Client | None = None,
        name: str = "default",
        *,
        max_queued: int | None = None,
        max_worker_failures: int | None = None,
        torch_threads: int | None = None,
        lease_timeout: float | None = None,
        resources: dict[str, float] | None = None,
        members: str | None = None,
        keep_alive: bool = False,
    ):
        if not isinstance(keep_alive, bool):
            raise TypeError(f"keep_alive must be True or False, got {keep_alive!r}")
        self._init_closures(max_queued)
        self._init_life(keep_alive)
        if max_worker_failures is None:
            max_worker_failures = checks.max_worker_failures(
                config.integer("coordinator.max-worker-failures"),
                "daskdist.coordinator.max-worker-failures")
        max_worker_failures = checks.max_worker_failures(max_worker_failures)
        lease_timeout = checks.optional(checks.lease_timeout, lease_timeout)
        resources = checks.optional(checks.resources, resources)
        members = checks.optional(checks.members, members)
        self.client = client if client is not None else get_client()
        if self.client.asynchronous:
            raise TypeError("Coordinator needs a synchronous Client (asynchronous=False)")
        self.name = checks.text(name, "name")
        self._rpc = self.client.scheduler
        # With `--preload daskdist.plugins.scheduler` the plugin is there and we register
        # nothing (such clusters may refuse client plugins); else register it once.
        if not self._plugin_loaded():
            self.client.register_plugin(_SchedulerPluginRef(), name=PLUGIN_NAME)
        info = self._call("daskdist_create", client=self.client.id,
                          max_worker_failures=max_worker_failures,
                          torch_threads=torch_threads, lease_timeout=lease_timeout,
                          **({"resources": resources} if resources else {}),
                          **({"members": members} if members else {}),
                          **({"keep_alive": True} if keep_alive else {}))
        if info is None:
            raise RuntimeError(
                "the daskdist scheduler plugin did not answer; is daskdist installed "
                "on the scheduler?"
            )
        self._begin(info)

    def _begin(self, info: dict) -> None:
        """Act as the owner the scheduler handed out (``info``: a create's or an
        attach's reply): its results loop and notices start."""
        self._workers = info["workers"]
        # this Coordinator's owner id (its closure ids start with it) and the secret
        # only it holds: the scheduler lets only the holder act as this owner
        self._owner: str = info["owner"]
        self._token: str = info["token"]
        self.client.loop.add_callback(self._results_loop)
        # stragglers and hangs of its gangs, logged as they happen (from the first gang)
        self._notices = NoticeListener(self.client, self.name, self._rpc,
                                       lambda: not self._closed)
        self._datasets = DatasetLink(self)  # what its dataset handles ask of it

    # -- plumbing ------------------------------------------------------------------------
    def _plugin_loaded(self) -> bool:
        try:
            return self.client.run_on_scheduler(_has_plugin)
        except Exception:  # running functions is refused here: ask a handler of ours
            return self._call("daskdist_status") is not None

    def _call(self, op: str, call_timeout: float | None = None, **kwargs: Any) -> Any:
        """Call a scheduler handler from the caller's thread."""
        fn = getattr(self._rpc, op)
        return self.client.sync(fn, name=self.name, callback_timeout=call_timeout, **kwargs)

    def _owned(self, op: str, call_timeout: float | None = None, **kwargs: Any) -> Any:
        """Call a handler that acts as this owner (it checks our token)."""
        return self._call(op, call_timeout, owner=self._owner, token=self._token, **kwargs)

    # -- public API (schedule, join, done, fetch: ClosureClient's) ----------------------
    def schedule_on_all(
        self, fn: Callable, args: tuple | list = (), kwargs: dict | None = None
    ) -> PerWorkerValues:
        """Run ``fn`` on every member of the collective group at once (a gang closure).

        Returns a ``PerWorkerValues`` of ``RemoteValue``s in rank order. If a member is
        lost, the group is re-formed from the current workers and the gang runs again;
        a worker that joins makes elastic ``State.commit()`` interrupt it, and it runs
        again on the group that includes the newcomer. A member that left is not an
        error: once the gang is done, the values (and ``fetch``) are the results of the
        ranks of the generation that completed it, in rank order, so their number is
        that generation's size (the values of ranks beyond it are cancelled).
        """
        self._check_open()
        if self._error_pending:
            self._raise_pending()
        payload = self._pickle(fn, args, kwargs, 0)
        self._notices.start()
        gid = f"{self._owner}-g{next(self._seq)}"
        whole = RemoteValue(gid, None, self._reader)
        view = GangValues(whole)
        with self._cv:
            self._pending[gid] = whole
            self._gangs[gid] = view
        try:
            info = self._owned("daskdist_schedule_gang", cid=gid, payload=payload)
        except BaseException:
            with self._cv:
                self._pending.pop(gid, None)
                self._gangs.pop(gid, None)
            raise
        n = info["world_size"]  # 0: no group could form yet; the gang waits for one
        with self._cv:
            if n and not view.final:  # not finished before we got here
                view.values = tuple(RemoteValue(f"{gid}#{r}", None, self._reader)
                                    for r in range(n))
        return view

    def collective_group(self, backend: str = "auto", timeout: float = 60.0, *,
                         rejoin_grace: float | None = None):
        """Bootstrap a torch.distributed group on the current workers, through Dask.

        Ranks follow worker indices; ``backend="auto"`` is NCCL when every member has a
        GPU of its own (their device UUIDs differ), else gloo (saying which workers share
        a GPU). Closures reach it with ``dd.collective.get_group()``.
        Collective calls that cannot complete fail with ``CollectiveError`` within
        ``timeout`` seconds. When a member is lost, the group re-forms on the
        survivors after ``rejoin_grace`` seconds (default
        ``daskdist.collective.rejoin-grace``: 0, at once); a replacement that registers
        later joins at the next elastic ``State.commit()``. Returns a
        ``daskdist.collective.CollectiveGroup``.
        """
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")

        self._check_open()
        info = self._owned("daskdist_group_form", backend=backend, timeout=float(timeout),
                           rejoin_grace=None if rejoin_grace is None else float(rejoin_grace))
        if not info["ok"]:
            why = f": {info['error']}" if info.get("error") else ""
            raise CollectiveError(
                f"could not form a collective group on {info['world_size']} workers "
                f"(generation {info['generation']}){why}")
        return CollectiveGroup(info["world_size"], info["generation"],
                               tuple(info["members"]), info["backend"])

    def create_per_worker_resource(self, fn: Callable[[Any], Any]) -> PerWorkerValues:
        """Build ``fn(ctx)`` on every worker (lazily, before a closure needs it); released
        on every worker when the handle is dropped or this Coordinator closes."""
        return self._register_resource("resource", fn)

    def create_per_worker_dataset(self, fn: Callable[[Any], Any],
                                  name: str | None = None) -> PerWorkerDataset:
        """Build ``fn(input_context)`` on every worker; ``iter()`` the result to get iterators.

        Each call is a new dataset: a ``"dynamic"`` ArrowLoader the factory builds
        leases under this dataset's id (``input_context.dataset_id``); ``name`` is a
        label. Its lease tables go when the handle is dropped or this coordinator closes.
        """
        values = self._register_resource("dataset", fn)
        self._define_dataset(DatasetDef(values.rid, name or "", None, 0))
        return PerWorkerDataset(self._datasets, values, name or "")

    def distribute_dataset(self, shards: Any, global_batch_size: int,
                           **loader_options: Any) -> DistributedDataset:
        """Per-worker ``ArrowLoader``s reading ``shards``, each with its replica's share
        of ``global_batch_size`` (TensorFlow's ``experimental_distribute_dataset``).

        ``loader_options`` are ArrowLoader's (``shuffle``, ``seed``, ``policy``,
        ``name``, ...). The shards are opened here first, so a bad source fails on the
        client. ``shards`` may also be a dask DataFrame or a dict of dask Arrays chunked
        alike along axis 0 (SPEC §3.2): its partitions are computed by Dask as members
        lease them, never all first (``policy`` defaults to ``"dynamic"``). Each call
        is a new dataset (``name`` is a label): re-running it, or two datasets over one
        directory, each read every row; resuming an epoch is explicit
        (``DistributedDataset.state_dict`` / ``load_state_dict``).
        """
        from daskdist.context import InputContext
        from daskdist.data.options import check_options
        from daskdist.data.sources import as_source

        if "batch_size" in loader_options:
            raise TypeError("pass global_batch_size; each worker's batch size derives from it")
        gbs = getattr(global_batch_size, "__index__", None)  # ints, numpy ints; not floats
        if isinstance(global_batch_size, bool) or gbs is None or gbs() < 1:
            raise ValueError(f"global_batch_size must be a positive int, got "
                             f"{global_batch_size!r}")
        global_batch_size = gbs()
        # ArrowLoader's options, checked here, before anything is registered (the loader
        # checks them again on each worker: one table, data/options.py)
        loader_options = check_options(loader_options, "distribute_dataset")
        # files, a dask DataFrame, a dict of dask Arrays: described (and checked) here
        source = as_source(shards, loader_options.get("columns"))
        workers = max(1, self._workers)  # the batch size is fixed now
        InputContext(num_replicas_in_sync=workers).get_per_replica_batch_size(global_batch_size)
        values = self._register_resource(
            "dataset", LoaderFactory(source, global_batch_size, loader_options, workers))
        name = loader_options.get("name") or ""
        seed = int(loader_options.get("seed", 0))
        # a new dataset, whatever its source or name: its units defined once, here
        self._define_dataset(source.definition(values.rid, name, seed,
                                               bool(loader_options.get("shuffle", False))))
        return DistributedDataset(self._datasets, values, source, name, seed)

    def _define_dataset(self, dataset: DatasetDef) -> None:
        self._owned("daskdist_dataset_define", dataset=tuple(dataset))

    def _register_resource(self, kind: str, fn: Callable | None,
                           parent: PerWorkerValues | None = None) -> PerWorkerValues:
        self._check_open()
        if kind != "iterator" and not callable(fn):
            raise TypeError(f"the per-worker {kind} factory must be callable, got {fn!r}")
        try:
            payload = cloudpickle.dumps(
                ResourceSpec(kind, fn, None if parent is None else parent.rid))
        except Exception as e:
            raise TypeError(f"the per-worker {kind} factory cannot be pickled: {e}") from e
        rid = f"{kind}-{uuid.uuid4().hex[:12]}"
        self._owned("daskdist_add_resource", rid=rid, payload=payload)
        handle = ResourceHandle(rid, kind, parent)
        weakref.finalize(handle, _dropped, weakref.ref(self), rid)
        return handle

    def async_model(self, model: Callable[[], Any], optimizer: Callable[[Any], Any],
                    outer: Any = None, max_staleness: int = 8) -> Any:
        """One model every closure trains, asynchronously (SPEC §2.8): ``model()`` builds
        the module (on every worker and for the global copy, which a worker holds with
        a standby copy on another), ``optimizer(params)`` a replica's inner optimizer,
        ``outer`` applies each pushed delta on the holder
        (``dd.asynchronous.Nesterov(lr=0.7, momentum=0.9)`` by default), and a delta
        pulled more than ``max_staleness`` versions ago is refused (its rows go back).
        Pass ``am.replica`` to closures: ``replica.pull()``, inner steps,
        ``replica.push()``. Returns a ``daskdist.client.asynchronous.AsyncModel`` once a
        worker holds the model; a bad setting raises before anything is registered. The
        model goes when this Coordinator closes, or when the handle and its replica are
        dropped (once every closure scheduled before has finished)."""
        from daskdist.client.asynchronous import create

        self._check_open()
        return create(model, optimizer, outer, max_staleness, call=self._call,
                      owned=self._owned, resource=self.create_per_worker_resource,
                      client=self.client, name=self.name)

    def report(self) -> Report:
        """Where each gang member's step time goes (SPEC §5.1): a row a rank of the current
        generation (steps, step time median and p90, its split into data, collective,
        commit and compute, data share, rows/s, GPU use where Dask's NVML metrics
        exist), the stragglers, whether the input pipeline is the bottleneck, and the
        stacks of the last collection until the next step. Its ``to_dict()``,
        ``to_pandas()``, and a table with a bar per rank in JupyterLab."""
        self._check_open()
        data = self._call("daskdist_rank_report")
        return Report(data, data.get("window", 0.0), self.name)

    def stacks(self) -> dict[int, str]:
        """Every gang member's Python stack of the thread running its gang closure, now:
        ``{rank: stack}`` (``traceback.format_stack`` form), collected from each worker's
        event loop, so a rank blocked in its closure answers too (within
        ``daskdist.observe.stacks-timeout``; a rank that does not is left out)."""
        self._check_open()
        return {int(rank): str(stack) for rank, stack in self._owned("daskdist_rank_stacks")}

    def status(self) -> dict[str, Any]:
        """Queue and worker counts: queued, running, done, failed, retried, cancelled,
        ...; ``preemptions``: the workers' deadlines, soonest first (``{worker, index,
        deadline, reason, seconds_left}`` each)."""
        self._check_open()
        s = self._call("daskdist_status")
        s["recoveries"] = s["recovered"]
        s["preemptions"] = [dict(p) for p in s.get("preemptions") or ()]
        return s

    def members(self) -> dict[str, list]:
        """Who works for this coordinator: ``{"members": [...], "helpers": [...]}``.

        Each member is ``{"address", "index", "device", "gpu"}`` as its worker reported
        it when it joined, in index (rank) order: ``device`` is what it bound
        (``"cuda:0"`` or ``"cpu"``), ``gpu`` the GPU it was given (the ``GPU-``/``MIG-``
        id of its ``CUDA_VISIBLE_DEVICES``, else its device's UUID, else the index it
        was given; ``""``: none). ``helpers`` are the workers that are not members
        (``resources=`` or ``members=``): they compute collections' partitions.
        """
        self._check_open()
        who = self._call("daskdist_members")
        return {"members": [dict(m) for m in who["members"]],
                "helpers": list(who["helpers"])}

    def _closure_state(self, cid: str) -> str | None:
        return self._call("daskdist_closure_state", cid=cid)

    @property
    def num_workers(self) -> int:
        return self.status()["workers"]

    def wait_for_workers(self, n: int, timeout: float | None = None) -> None:
        """Block until ``n`` workers have joined this coordinator and built its
        per-worker resources, so a gang scheduled next has them all (``TimeoutError``
        after ``timeout`` seconds). Workers join once their plugin is set up."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def ready() -> int:
            status = self.status()
            return status["workers"] - status["warming"]

        while ready() < n:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{ready()} of {n} workers joined (their per-worker "
                                   f"resources built) within {timeout} s")
            with self._cv:
                self._cv.wait(0.05)  # woken early by results; re-check the count

    def close(self) -> None:
        """Close this Coordinator, ending every wait at once (SPEC §2.5b).

        Every pending ``RemoteValue`` resolves now: its value if its closure had
        finished, else ``dd.CoordinatorClosedError`` (a ``dd.CancelledError``) saying the
        coordinator closed; queued closures are cancelled (running ones finish on their
        workers, their results dropped); this Coordinator's per-worker resources and
        iterators are released on every worker; ``schedule`` / ``join`` / ``fetch``
        raise at once from now on. When no Coordinator of this name is left, the
        scheduler drops its queue and its worker plugin (threads, timers) goes from every
        worker. Closing twice does nothing.
        """
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        try:
            items = self._owned("daskdist_detach", call_timeout=10)["items"]
        except Exception:  # the scheduler is gone: nothing more will finish
            items = []
        for item in items:  # finished before the close: their values stay fetchable
            self._resolve(Outcome._make(item))
        self._cancel_all("close() was called")

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Coordinator {self.name!r} scheduler={self.client.scheduler.address}>"

    def _repr_html_(self) -> str:
        return reprs.coordinator_html(self)


class DatasetLink:
    """What a ``Coordinator``'s dataset handles ask of it
    (:class:`~daskdist.client.datasets.DatasetCoordinator`), by name: the calls to the
    scheduler they need, acting as its owner where one must."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def workers(self, ask: bool = False) -> int:
        co = self.coordinator
        return co.num_workers if ask else co._workers

    def register_iterator(self, factory: Callable | None,
                          dataset: PerWorkerValues) -> PerWorkerValues:
        return self.coordinator._register_resource("iterator", factory, parent=dataset)

    def progress(self, dataset_id: str, epoch: int) -> dict:
        return self.coordinator._call("daskdist_lease_progress", dataset_id=dataset_id,
                                      epoch=epoch)

    def ledger(self, dataset_id: str, epoch: int) -> EpochLedger:
        return EpochLedger._make(self.coordinator._call(
            "daskdist_dataset_state", dataset_id=dataset_id, epoch=epoch))

    def start_epoch(self, ledger: EpochLedger) -> None:
        self.coordinator._owned("daskdist_dataset_start", ledger=tuple(ledger))


def _dropped(coordinator: weakref.ref, rid: str) -> None:
    co = coordinator()
    if co is not None and not co._closed:
        co._resource_dropped(rid)
