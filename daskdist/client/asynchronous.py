"""``coord.async_model(...)``: the client's handle of one model trained asynchronously
(SPEC §2.8).

The client holds nothing the job needs: the global model lives on a worker (its holder,
with a standby copy on another), the scheduler's book keeps its versions and the rows
its pushes wait with. :class:`AsyncModel` asks the book (``version``, ``holders()``,
``report()``, ``checkpoint_to``) and, for ``state_dict()``, the holder itself. Its
``replica`` is the closure argument every round trains. Settings are checked here,
before anything is registered. Loads no torch until ``state_dict()``.
"""

from __future__ import annotations

import html
import os
import uuid
from collections.abc import Callable
from typing import Any

import cloudpickle

from daskdist.asynchronous.factory import ReplicaFactory
from daskdist.asynchronous.outer import Nesterov, OuterOptimizer
from daskdist.asynchronous.spec import AsyncSpec
from daskdist.client.reprs import STYLE
from daskdist.core import checks
from daskdist.core.asynchronous import protocol as async_protocol
from daskdist.errors import CoordinatorClosedError


class AsyncReport(dict):
    """``am.report()``: versions applied per second, staleness (median, p90, max), deltas
    applied and refused, per-worker rounds, rows and bytes per round, the bytes that went
    through the scheduler, where the model is. A dict; a table in JupyterLab."""

    def to_dict(self) -> dict:
        return dict(self)

    def _repr_html_(self) -> str:
        st = self["staleness"]
        head = (f"<b>async model</b> <code>{html.escape(self['model'])}</code> version "
                f"{self['version']} ({self['phase']}) · {self['versions_per_second']:.1f} "
                f"versions/s · staleness median {st['median']:g}, p90 {st['p90']:g}, max "
                f"{st['max']} · applied {self['applied']}, refused {self['refused']} · "
                f"{self['bytes_per_round'] / 1e6:.2f} MB a round · holder "
                f"{html.escape(self['holder'] or '-')}, standby "
                f"{html.escape(self['standby'] or '-')}")
        rows = "".join(
            f"<tr><td>{html.escape(w['address'])}</td><td>{w['rounds']}</td>"
            f"<td>{w['rows']}</td><td>{w['refused']}</td>"
            f"<td>{w['bytes_per_round'] / 1e6:.2f}</td>"
            f"<td>{w['steps_per_second']:.1f}</td></tr>" for w in self["workers"])
        return (f"<div style='{STYLE}'>{head}<table><tr><th>worker</th><th>rounds</th><th>rows</th>"
                f"<th>refused</th><th>MB/round</th><th>steps/s</th></tr>{rows}</table></div>")


class AsyncModel:
    """One model every closure's ``replica`` trains asynchronously (``coord.async_model``).

    ``replica``: the closure argument (on a worker: ``.model``, ``.optimizer``,
    ``.version``, ``.pull()``, ``.push()``, ``.suggested_steps(n)``). ``version``: the
    global model's newest version (never goes back). ``state_dict()``: the global model
    as CPU tensors. ``holders()``: the workers holding it, the holder first.
    ``checkpoint_to(url, every)``: durable checkpoints with the datasets' ledgers.
    ``report()``: its figures."""

    def __init__(self, model_id: str, replica: Any, info: dict,
                 call: Callable[..., Any], owned: Callable[..., Any], client: Any,
                 name: str) -> None:
        self.model_id = model_id
        self.replica = replica
        self._call, self._owned, self._client, self._name = call, owned, client, name
        self._info = info

    def info(self) -> dict:
        """The book's word now: version, phase, holder, standby; ``RuntimeError`` once
        the model failed (every holder lost without a checkpoint)."""
        info = self._call("daskdist_async_info", model=self.model_id)
        if info.get("failed"):
            raise RuntimeError(info["failed"])
        self._info = info
        return info

    @property
    def version(self) -> int:
        return int(self.info()["version"])

    def holders(self) -> list[str]:
        """The addresses of the workers holding the global model: the holder, then its
        standby (while it has one)."""
        info = self.info()
        return [a for a in (info["holder"], info["standby"]) if a]

    def state_dict(self) -> dict:
        """The global model's parameters and buffers, as CPU tensors (fetched from its
        holder directly)."""
        from daskdist.asynchronous import flat

        holder = self.info()["holder"]
        if not holder:
            raise RuntimeError(f"asynchronous model {self.model_id} is moving to a new "
                               "holder; ask again")
        reply = self._client.sync(self._client.rpc(holder).daskdist_async_pull,
                                  name=self._name, model=self.model_id, incarnation=-1,
                                  version=-1)
        if isinstance(reply, dict):
            raise RuntimeError(f"asynchronous model {self.model_id}: its holder moved; "
                               "ask again")
        p = checks.named(reply, "daskdist_async_pull reply", async_protocol.Pulled)
        layout = [tuple(x) for x in p.layout]
        n = int(p.nparams)
        tensors = flat.unpack(p.params, layout[:n]) + flat.unpack(p.buffers, layout[n:])
        return {name: t for (name, _, _), t in zip(layout, tensors, strict=True)}

    def checkpoint_to(self, url: str, every: int = 1) -> AsyncModel:
        """Write the global model every ``every`` versions under ``url`` (any fsspec
        URL), with the ledger of its ``"dynamic"`` datasets at that version. Before
        anything was applied, the newest checkpoint there is loaded first (a job resumed
        on a new cluster, with datasets of the same names). Returns the model."""
        url = checks.text(url, "checkpoint_to: url", 4096)
        if "://" not in url:
            url = os.path.abspath(url)
        every = async_protocol.every(every, "checkpoint_to: every")
        self._info = _served(self._owned("daskdist_async_checkpoint", model=self.model_id,
                                         url=url, every=every))
        return self

    def report(self) -> AsyncReport:
        """Versions applied per second, staleness median / p90 / max, deltas refused,
        per-worker rounds and rows, bytes moved per round (and through the scheduler)."""
        return AsyncReport(self._call("daskdist_async_report", model=self.model_id))

    def __repr__(self) -> str:
        return f"<AsyncModel {self.model_id} version {self._info.get('version', 0)}>"


def _served(reply: dict) -> dict:
    """The book's answer once a worker serves the model; its coordinator closed
    meanwhile: ``CoordinatorClosedError``."""
    if reply.get("closed"):
        raise CoordinatorClosedError(reply["closed"])
    return reply


def create(model: Any, optimizer: Any, outer: Any, max_staleness: Any, *,
           call: Callable[..., Any], owned: Callable[..., Any],
           resource: Callable[[Any], Any], client: Any, name: str) -> AsyncModel:
    """``coord.async_model``: check the settings (nothing is registered if one is bad),
    register the replicas and the model; returns once a worker holds it."""
    if not callable(model) or (hasattr(model, "parameters") and hasattr(model, "forward")):
        raise TypeError(f"async_model: model must be a callable that builds the module "
                        f"(called with no argument, on every worker: model=lambda: Net()), "
                        f"got {type(model).__name__} {model!r:.60}")
    if not callable(optimizer):
        raise TypeError(f"async_model: optimizer must be a callable taking the parameters "
                        f"(e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)), got "
                        f"{optimizer!r:.60}")
    if outer is None:
        outer = Nesterov()
    if not isinstance(outer, OuterOptimizer):
        raise TypeError(f"async_model: outer must be an outer optimizer "
                        f"(dd.asynchronous.Nesterov, Average, DelayedNesterov, Mixing or an "
                        f"OuterOptimizer), got {type(outer).__name__} {outer!r:.60}")
    max_staleness = async_protocol.max_staleness(max_staleness, "async_model: max_staleness")
    model_id = f"async-{uuid.uuid4().hex[:12]}"
    spec = AsyncSpec(model_id, model, optimizer, outer, max_staleness)
    try:
        payload = cloudpickle.dumps(spec)
    except Exception as e:
        raise TypeError(f"async_model: the model, optimizer or outer cannot be pickled: "
                        f"{e}") from e
    replica = resource(ReplicaFactory(spec))
    info = _served(owned("daskdist_async_create", model=model_id, spec=payload,
                         max_staleness=max_staleness, replica=replica.rid))
    return AsyncModel(model_id, replica, info, call, owned, client, name)
