"""Observability on the scheduler: ``/daskdist`` (plain HTML), ``/daskdist/status.json``,
the Bokeh pages of :mod:`daskdist.plugins.scheduler.web.dashboard` and Prometheus metrics.

All of them read :func:`daskdist.plugins.scheduler.stats.snapshot` of each coordinator; nothing here
changes state. :func:`install` is called by the scheduler plugin's ``start``: it adds the
routes to the scheduler's HTTP server (when it serves one), the Bokeh pages to its
dashboard (when Bokeh is installed), starts the history sampler (a periodic callback on
the scheduler's event loop, which stops itself once the scheduler closes) and joins the
metrics to the scheduler's ``/metrics`` (when ``prometheus_client`` is installed).
"""

from __future__ import annotations

import html
import json
import logging
from typing import Any

from tornado.ioloop import PeriodicCallback
from tornado.web import RequestHandler

from daskdist import config
from daskdist.observe.steptimes import PHASES
from daskdist.plugins.scheduler.stats import CoordinatorStats, snapshots

logger = logging.getLogger(__name__)

COUNTERS = ("scheduled", "done", "failed", "retried", "cancelled", "recovered")
GAUGES = ("queued", "running", "workers", "group_generation", "group_size")


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in columns)
                   + "</tr>" for r in rows)
    return f"<table border='1'><tr>{head}</tr>{body}</table>"


def _fmt(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


class StatusPage(RequestHandler):
    """Plain HTML for curl users: one section per coordinator, refreshed every two seconds."""

    def initialize(self, plugin: Any) -> None:
        self.plugin = plugin

    def get(self) -> None:
        parts = ["<html><head><title>daskdist</title>",
                 "<meta http-equiv='refresh' content='2'></head><body>",
                 "<h2>daskdist coordinators</h2>",
                 "<p><a href='daskdist-dashboard'>plots</a> · "
                 "<a href='daskdist/status.json'>status.json</a></p>"]
        for name, snap in snapshots(self.plugin).items():
            status = [{"counter": k, "value": v} for k, v in snap["status"].items()
                      if not isinstance(v, (dict, list))]
            group = [{"field": k, "value": v} for k, v in snap["group"].items()]
            parts += [f"<h3>{html.escape(name)}</h3>",
                      _table(status, ["counter", "value"]),
                      "<h4>workers</h4>",
                      _table(snap["workers"], ["address", "index", "closures", "rows",
                                               "closures_per_second", "rows_per_second"]),
                      "<h4>dynamic datasets (newest epoch)</h4>",
                      _table(snap["datasets"], ["name", "dataset_id", "epoch",
                                                "acknowledged", "leased", "free", "total",
                                                "complete", "failed"]),
                      "<h4>preemption deadlines</h4>",
                      _table(snap["status"].get("preemptions") or [],
                             ["worker", "index", "reason", "seconds_left"]),
                      "<h4>collective group</h4>", _table(group, ["field", "value"]),
                      "<h4>group events</h4>",
                      _table(snap["events"], ["kind", "generation", "members", "seconds",
                                              "worker"]),
                      "<h4>gang ranks (mean seconds a step)</h4>",
                      _table(_rank_rows(snap["ranks"]), ["rank", "worker", "steps",
                                                         "median", *PHASES, "straggler"]),
                      "<h4>asynchronous models</h4>",
                      _table(_async_rows(snap["async_models"]), list(ASYNC_COLUMNS)),
                      "<h4>batch-inference jobs</h4>",
                      _table(snap["inference"], ["name", "state", "units", "rows", "total",
                                                 "out_rows", "rows_per_second",
                                                 "units_per_second", "output", "error"]),
                      "<h4>batch inference per worker</h4>",
                      _table(_infer_rows(snap["inference"]), ["job", "address", "units",
                                                              "rows", "rows_per_second",
                                                              "failures"])]
        if not self.plugin.coordinators:
            parts.append("<p>No coordinator yet.</p>")
        parts.append("</body></html>")
        self.set_header("Content-Type", "text/html")
        self.write("".join(parts))


def _rank_rows(report: dict) -> list[dict]:
    """The rank book's report as rows of the plain page."""
    slow = {s["rank"]: s["cause"] for s in report.get("stragglers") or []}
    return [{"rank": r["rank"], "worker": r["worker"], "steps": r["steps"],
             "median": r["step_seconds"]["median"], **r["phases"],
             "straggler": slow.get(r["rank"], "")} for r in report.get("ranks") or []]


ASYNC_COLUMNS = ("model", "worker", "version", "versions/s", "staleness p90", "applied",
                 "refused", "rounds", "rows", "MB/round")


def _async_rows(reports: list[dict]) -> list[dict]:
    """A row per asynchronous model, then one per worker training it."""
    rows = []
    for r in reports:
        rows.append({"model": r["model"], "worker": r["holder"], "version": r["version"],
                     "versions/s": r["versions_per_second"],
                     "staleness p90": r["staleness"]["p90"], "applied": r["applied"],
                     "refused": r["refused"], "rows": r["rows"],
                     "MB/round": r["bytes_per_round"] / 1e6})
        rows += [{"model": "", "worker": w["address"], "rounds": w["rounds"],
                  "rows": w["rows"], "refused": w["refused"],
                  "MB/round": w["bytes_per_round"] / 1e6} for w in r["workers"]]
    return rows


def _infer_rows(jobs: list[dict]) -> list[dict]:
    """Each batch-inference job's workers as rows of the plain page."""
    return [{"job": j["name"], **w} for j in jobs for w in j["workers"]]


class StatusJSON(RequestHandler):
    """``{"coordinators": {name: snapshot}}``: what the plain page and the plots show."""

    def initialize(self, plugin: Any) -> None:
        self.plugin = plugin

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"coordinators": snapshots(self.plugin)}))


class MetricsCollector:
    """``daskdist_*`` metrics (Prometheus naming: ``_total`` counters, ``_seconds``)."""

    def __init__(self, plugin: Any):
        self.plugin = plugin

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        co_label = ["coordinator"]
        fams: dict[str, Any] = {}
        for key in COUNTERS:  # CounterMetricFamily appends "_total"
            fams[key] = CounterMetricFamily(f"daskdist_closures_{key}",
                                            f"Closures {key}, per coordinator", labels=co_label)
        for key in GAUGES:
            fams[key] = GaugeMetricFamily(f"daskdist_{key}",
                                          f"{key.replace('_', ' ')}, per coordinator",
                                          labels=co_label)
        recoveries = CounterMetricFamily(
            "daskdist_recoveries", "Closures re-run after their worker was lost", labels=co_label)
        reformations = CounterMetricFamily(
            "daskdist_group_reformations", "Collective group formations after the first",
            labels=co_label)
        losses = CounterMetricFamily(
            "daskdist_group_member_losses", "Collective group members lost", labels=co_label)
        formation = GaugeMetricFamily(
            "daskdist_group_formation_seconds", "Duration of the last group formation",
            labels=co_label)
        expiries = CounterMetricFamily(
            "daskdist_lease_expiries", "Worker sessions ended by lease expiry", labels=co_label)
        lost = CounterMetricFamily(
            "daskdist_workers_lost", "Workers removed unexpectedly (killed, cut off)",
            labels=co_label)
        w_closures = CounterMetricFamily(
            "daskdist_worker_closures", "Closures done, per worker",
            labels=["coordinator", "worker"])
        w_rows = CounterMetricFamily(
            "daskdist_worker_rows_acknowledged", "Dynamic-policy rows acknowledged, per worker",
            labels=["coordinator", "worker"])
        d_rows = CounterMetricFamily(
            "daskdist_dataset_rows_acknowledged", "Rows acknowledged, per dataset (all epochs)",
            labels=["coordinator", "dataset"])
        d_epoch = GaugeMetricFamily(
            "daskdist_dataset_epoch_rows", "Rows of the dataset's newest epoch, by state",
            labels=["coordinator", "dataset", "epoch", "state"])
        ck_total = CounterMetricFamily(
            "daskdist_checkpoints", "Checkpoints written by State.checkpoint_to",
            labels=co_label)
        ck_step = GaugeMetricFamily(
            "daskdist_checkpoint_step", "Commit held by the newest complete checkpoint",
            labels=co_label)
        ck_age = GaugeMetricFamily(
            "daskdist_checkpoint_age_seconds", "Seconds since the newest checkpoint completed",
            labels=co_label)
        ck_secs = GaugeMetricFamily(
            "daskdist_checkpoint_write_seconds", "Duration of the newest checkpoint's write",
            labels=co_label)
        ck_bytes = GaugeMetricFamily(
            "daskdist_checkpoint_bytes", "Size of the newest checkpoint", labels=co_label)
        for name, snap in snapshots(self.plugin).items():
            status, group = snap["status"], snap["group"]
            for key, family in fams.items():
                family.add_metric([name], status[key])
            recoveries.add_metric([name], status["recovered"])
            reformations.add_metric([name], group["reformations"])
            losses.add_metric([name], group["losses"])
            formation.add_metric([name], group.get("bootstrap_seconds", 0.0))
            expiries.add_metric([name], status.get("lease_expiries", 0))
            lost.add_metric([name], status.get("workers_lost", 0))
            for w in snap["workers"]:
                w_closures.add_metric([name, w["address"]], w["closures"])
                w_rows.add_metric([name, w["address"]], w["rows"])
            for dataset, rows in snap["dataset_rows_acknowledged"].items():
                d_rows.add_metric([name, dataset], rows)
            for d in snap["datasets"]:
                for state in ("acknowledged", "leased", "free"):
                    d_epoch.add_metric([name, d["dataset_id"], str(d["epoch"]), state], d[state])
            ck_total.add_metric([name], group.get("checkpoints", 0))
            ck = group.get("checkpoint")
            if ck:
                ck_step.add_metric([name], ck["commits"])
                ck_age.add_metric([name], ck["age_seconds"])
                ck_secs.add_metric([name], ck["seconds"])
                ck_bytes.add_metric([name], ck["nbytes"])
        yield from self._ranks()
        yield from self._async_models()
        yield from self._inference()
        yield from fams.values()
        yield from (recoveries, reformations, losses, formation, expiries, lost,
                    w_closures, w_rows, d_rows, d_epoch, ck_total, ck_step, ck_age, ck_secs,
                    ck_bytes)


    def _ranks(self):
        """Per gang rank (SPEC §5.1): median step time, seconds in each phase, rows, and
        whether it is a straggler; labelled by coordinator, rank and worker."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["coordinator", "rank", "worker"]
        step = GaugeMetricFamily("daskdist_rank_step_seconds",
                                 "Median step time of each gang rank (its last 3 windows)",
                                 labels=labels)
        phase = CounterMetricFamily("daskdist_rank_phase_seconds",
                                    "Seconds of each gang rank's steps, by phase",
                                    labels=[*labels, "phase"])
        rows = CounterMetricFamily("daskdist_rank_rows",
                                   "Rows daskdist loaders handed each gang rank's steps",
                                   labels=labels)
        straggler = GaugeMetricFamily("daskdist_rank_straggler",
                                      "1 while a gang rank is a straggler, else 0",
                                      labels=labels)
        for name, co in sorted(self.plugin.coordinators.items()):
            for rank, worker, totals, median, slow in co.rank_totals():
                values = [name, str(rank), worker]
                step.add_metric(values, median)
                for i, p in enumerate(PHASES):
                    phase.add_metric([*values, p], totals[i])
                rows.add_metric(values, totals[-1])
                straggler.add_metric(values, float(slow))
        return step, phase, rows, straggler

    def _async_models(self):
        """Per asynchronous model (SPEC §2.8): its version, versions applied per second,
        staleness, deltas applied and refused, holder losses and hand-overs, bytes per
        round; per worker, its rounds and rows. Labelled by coordinator and model (and
        worker)."""
        fams = _families("daskdist_async_", ASYNC_METRICS, ["coordinator", "model"])
        for name, co in sorted(self.plugin.coordinators.items()):
            for r in co.async_reports():
                values = [name, r["model"]]
                for key in ("version", "versions_per_second", "applied", "refused",
                            "holder_losses", "handovers", "bytes_per_round"):
                    fams[key].add_metric(values, r[key])
                for q in ("median", "p90", "max"):
                    fams["staleness"].add_metric([*values, q], r["staleness"][q])
                for w in r["workers"]:
                    for key in ("rounds", "rows"):
                        fams[f"worker_{key}"].add_metric([*values, w["address"]], w[key])
        return tuple(fams.values())

    def _inference(self):
        """Per batch-inference job (SPEC §7): units and rows committed, rows a second,
        whether it runs; per worker its units, rows and unit failures."""
        fams = _families("daskdist_infer_", INFER_METRICS, ["coordinator", "job"])
        for name, co in sorted(self.plugin.coordinators.items()):
            for j in co.inference_report():
                values = [name, j["name"]]
                running = float(j["state"] in ("running", "finalizing"))
                for key in ("units", "rows", "out_rows", "rows_per_second"):
                    fams[key].add_metric(values, j[key])
                fams["running"].add_metric(values, running)
                for w in j["workers"]:
                    for key in ("units", "rows", "failures"):
                        fams[f"worker_{key}"].add_metric([*values, w["address"]], w[key])
        return tuple(fams.values())


def _families(prefix: str, table: tuple, labels: list[str]) -> dict:
    """A metric family per row of ``table`` (key, name, help, a counter (else a gauge),
    the label it adds or ``None``), by key."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return {key: (CounterMetricFamily if counter else GaugeMetricFamily)(
                f"{prefix}{name}", text, labels=labels + ([extra] if extra else []))
            for key, name, text, counter, extra in table}


# daskdist_async_* metrics: (key, name, help, a counter (else a gauge), label added)
ASYNC_METRICS = (
    ("version", "version", "The global model's newest version", False, None),
    ("versions_per_second", "versions_per_second", "Versions applied per second (recent)",
     False, None),
    ("staleness", "staleness", "Staleness of applied deltas (versions since their pull)",
     False, "quantile"),
    ("applied", "deltas_applied", "Deltas applied to the global model", True, None),
    ("refused", "deltas_refused", "Deltas refused (staleness over max_staleness)", True,
     None),
    ("holder_losses", "holder_losses", "Holders of the global model lost", True, None),
    ("handovers", "handovers", "Moves to the standby before a holder's preemption deadline",
     True, None),
    ("bytes_per_round", "bytes_per_round", "Bytes a round moves (its pull and its push)",
     False, None),
    ("worker_rounds", "worker_rounds", "Rounds (pushes decided), per worker", True,
     "worker"),
    ("worker_rows", "worker_rows", "Rows of applied deltas, per worker", True, "worker"),
)


# daskdist_infer_* metrics: (key, name, help, a counter (else a gauge), label added)
INFER_METRICS = (
    ("units", "units", "Units a batch-inference job committed", True, None),
    ("rows", "rows", "Input rows a batch-inference job committed", True, None),
    ("out_rows", "output_rows", "Output rows a batch-inference job committed", True, None),
    ("rows_per_second", "rows_per_second", "Rows a second a batch-inference job commits",
     False, None),
    ("running", "running", "1 while a batch-inference job runs, else 0", False, None),
    ("worker_units", "worker_units", "Units committed, per worker", True, "worker"),
    ("worker_rows", "worker_rows", "Input rows committed, per worker", True, "worker"),
    ("worker_failures", "unit_failures", "Units whose read or predict raised, per worker",
     True, "worker"),
)


class Sampler:
    """Appends a history sample of every coordinator each ``dashboard.sample-interval``.

    Runs on the scheduler's event loop (a tornado ``PeriodicCallback``); stops itself
    once the scheduler is closed.
    """

    def __init__(self, plugin: Any, scheduler: Any):
        self.plugin = plugin
        self.scheduler = scheduler
        interval_ms = 1000 * config.seconds("dashboard.sample-interval")
        self.callback = PeriodicCallback(self.tick, interval_ms)

    def tick(self) -> None:
        status = getattr(self.scheduler, "status", None)
        if status is not None and getattr(status, "name", "") in ("closing", "closed"):
            self.callback.stop()
            return
        history = int(config.get("dashboard.history"))
        for co in list(self.plugin.coordinators.values()):
            stats: CoordinatorStats = co.stats
            if stats.history.maxlen != history:
                stats.history = type(stats.history)(stats.history, maxlen=max(2, history))
            stats.sample(co)


_collector: MetricsCollector | None = None


def install(plugin: Any, scheduler: Any) -> Sampler:
    """Add the pages to the scheduler's HTTP server and the metrics to Prometheus; the
    history sampler, started (the plugin stops it when it closes)."""
    global _collector
    sampler = Sampler(plugin, scheduler)
    sampler.tick()
    sampler.callback.start()
    app = getattr(scheduler, "http_application", None)
    if app is not None:
        app.add_handlers(r".*", [(r"/daskdist", StatusPage, {"plugin": plugin}),
                                 (r"/daskdist/status\.json", StatusJSON, {"plugin": plugin})])
        try:
            from daskdist.plugins.scheduler.web import dashboard
        except ImportError as e:  # Bokeh missing: Dask has no dashboard either
            logger.info("daskdist: no Bokeh pages (%s)", e)
        else:
            try:
                dashboard.install(plugin, scheduler)
            except Exception as e:  # a Bokeh whose server internals differ: no plots
                logger.warning("daskdist: dashboard pages not installed: %r", e)
    try:
        import prometheus_client
    except ImportError:
        return sampler
    if _collector is None:
        _collector = MetricsCollector(plugin)
        prometheus_client.REGISTRY.register(_collector)
    else:
        _collector.plugin = plugin  # a later scheduler in the same process
    return sampler
