"""daskdist's Bokeh pages in the Dask dashboard, built the way Dask builds its own.

Each page is a Bokeh server document on the scheduler's dashboard (the scheduler's own
``BokehTornado``), refreshed by a periodic callback on the scheduler's event loop that
reads :func:`daskdist.plugins.scheduler.stats.snapshot` (never imports torch or pyarrow):

- ``/daskdist-dashboard``: every plot below, in Dask's page template, listed in the
  dashboard's navigation bar;
- ``/individual-daskdist-closures``, ``-workers``, ``-datasets``, ``-group``, ``-ranks``
  (:mod:`.rankpanel`: the gang's per-rank phases and stragglers): one plot each, listed
  in ``/individual-plots.json`` (what dask-labextension reads), so a JupyterLab user can
  dock them.

Dask creates its Bokeh applications when the scheduler starts, before plugins and
preloads run, so :func:`install` adds ours to the running ``BokehTornado`` the way its
constructor adds each application (routes from ``bokeh.server.urls.per_app_patterns``).
"""

from __future__ import annotations

import functools
import html
import logging
from typing import Any

from bokeh.application import Application
from bokeh.application.handlers.document_lifecycle import DocumentLifecycleHandler
from bokeh.application.handlers.function import FunctionHandler
from bokeh.layouts import column, row
from bokeh.models import (
    ColumnDataSource,
    DatetimeTickFormatter,
    Div,
    FactorRange,
    HoverTool,
    LabelSet,
    NumeralTickFormatter,
    Select,
)
from bokeh.plotting import figure

from daskdist import config
from daskdist.observe.panel import RankPanel
from daskdist.plugins.scheduler.stats import snapshots

logger = logging.getLogger(__name__)

PAGE = "daskdist-dashboard"
PARTS = ("closures", "workers", "datasets", "group", "ranks")  # the individual pages
COLORS = {"done": "#2ca02c", "failed": "#d62728", "retried": "#ff7f0e",
          "recovered": "#9467bd", "queued": "#1f77b4", "running": "#17becf",
          "acknowledged": "#2ca02c", "leased": "#ff7f0e", "free": "#c7c7c7"}


def _pick(snaps: dict[str, dict], wanted: str | None) -> dict | None:
    """The chosen coordinator's snapshot; else the one that scheduled the most closures."""
    if wanted in snaps:
        return snaps[wanted]
    if not snaps:
        return None
    return max(snaps.values(), key=lambda s: s["status"].get("scheduled", 0))


def _time_ms(values: list[float]) -> list[float]:
    return [1000.0 * v for v in values]


def _checkpoint_text(ck: dict | None) -> str:
    """The newest complete checkpoint, for the group panel."""
    if not ck:
        return "checkpoint: none written"
    return (f"checkpoint: step {ck['commits']} · {ck['age_seconds']:.0f} s ago · written "
            f"in {ck['seconds']:.2f} s ({ck['nbytes'] / 2**20:.1f} MiB) · "
            f"{html.escape(ck['url'])}")


class DaskdistDashboard:
    """The plots of one document; ``update`` refreshes them from the plugin's coordinators."""

    def __init__(self, plugin: Any, **fig: Any):
        self.plugin = plugin
        fig.setdefault("sizing_mode", "stretch_width")
        self.select = Select(title="coordinator", options=[], value="", width=240)
        self.summary = Div(text="", sizing_mode="stretch_width")

        # closures per second over time, and queued / running
        self.rates = ColumnDataSource({k: [] for k in (
            "time", "done", "failed", "retried", "recovered", "queued", "running")})
        self.closures = figure(title="Closures per second", x_axis_type="datetime",
                               height=230, tools="pan,wheel_zoom,box_zoom,reset,save",
                               name="daskdist-closures", **fig)
        for key in ("done", "failed", "retried", "recovered"):
            self.closures.line("time", key, source=self.rates, color=COLORS[key],
                               legend_label=key, line_width=2)
        self.backlog = figure(title="Queued and running closures", x_axis_type="datetime",
                              height=180, tools="pan,wheel_zoom,box_zoom,reset,save",
                              x_range=self.closures.x_range, name="daskdist-backlog", **fig)
        for key in ("queued", "running"):
            self.backlog.line("time", key, source=self.rates, color=COLORS[key],
                              legend_label=key, line_width=2)
        for f in (self.closures, self.backlog):
            f.xaxis.formatter = DatetimeTickFormatter(seconds="%H:%M:%S", minsec="%H:%M:%S",
                                                      minutes="%H:%M")
            f.legend.location = "top_left"
            f.legend.orientation = "horizontal"
            f.y_range.start = 0

        # per worker: closures and rows per second
        self.workers = ColumnDataSource({k: [] for k in (
            "worker", "closures_per_second", "rows_per_second", "closures", "rows")})
        hover = HoverTool(tooltips=[("worker", "@worker"), ("closures/s", "@closures_per_second"),
                                    ("rows/s", "@rows_per_second"), ("closures", "@closures"),
                                    ("rows", "@rows")])
        self.worker_closures = figure(title="Closures per second, per worker",
                                      y_range=FactorRange(), height=200, tools=[hover],
                                      name="daskdist-worker-closures", **fig)
        self.worker_closures.hbar(y="worker", right="closures_per_second", height=0.7,
                                  source=self.workers, color=COLORS["done"])
        self.worker_rows = figure(title="Rows per second, per worker (dynamic datasets)",
                                  y_range=self.worker_closures.y_range, height=200,
                                  tools=[hover.clone()], name="daskdist-worker-rows", **fig)
        self.worker_rows.hbar(y="worker", right="rows_per_second", height=0.7,
                              source=self.workers, color=COLORS["queued"])
        for f in (self.worker_closures, self.worker_rows):
            f.x_range.start = 0

        # per dynamic dataset: the newest epoch's acknowledged / leased / free rows
        self.datasets = ColumnDataSource({k: [] for k in (
            "dataset", "acknowledged", "leased", "free", "total")})
        self.dataset_bars = figure(
            title="Dynamic datasets: rows of the newest epoch", y_range=FactorRange(),
            height=200, name="daskdist-datasets",
            tools=[HoverTool(tooltips=[("", "@dataset"), ("acknowledged", "@acknowledged"),
                                       ("leased", "@leased"), ("free", "@free"),
                                       ("total", "@total")])], **fig)
        self.dataset_bars.hbar_stack(["acknowledged", "leased", "free"], y="dataset",
                                     height=0.7, source=self.datasets,
                                     color=[COLORS[k] for k in ("acknowledged", "leased", "free")],
                                     legend_label=["acknowledged", "leased", "free"])
        self.dataset_bars.x_range.start = 0
        self.dataset_bars.xaxis.formatter = NumeralTickFormatter(format="0,0")
        self.dataset_bars.legend.orientation = "horizontal"
        self.dataset_bars.legend.location = "bottom_right"

        # the collective group: a summary and a timeline of losses and (re-)formations
        self.group = Div(text="", sizing_mode="stretch_width")
        self.events = ColumnDataSource({k: [] for k in (
            "time", "generation", "kind", "label", "color", "marker", "worker")})
        self.timeline = figure(
            title="Group losses (x) and formations (o), labelled with their seconds",
            x_axis_type="datetime", height=200, name="daskdist-group",
            tools=[HoverTool(tooltips=[("", "@kind"), ("generation", "@generation"),
                                       ("", "@label"), ("worker", "@worker")]),
                   "pan", "wheel_zoom", "reset"], **fig)
        self.timeline.scatter("time", "generation", source=self.events, color="color",
                              size=12, marker="marker")
        self.timeline.add_layout(LabelSet(x="time", y="generation", text="label",
                                          source=self.events, x_offset=6, y_offset=6,
                                          text_font_size="10pt"))
        self.timeline.yaxis.axis_label = "generation"
        self.timeline.xaxis.formatter = DatetimeTickFormatter(
            milliseconds="%H:%M:%S.%3N", seconds="%H:%M:%S", minsec="%H:%M:%S",
            minutes="%H:%M")
        self.timeline.x_range.range_padding = 0.2
        self.timeline.y_range.range_padding = 0.3
        self.timeline.yaxis.ticker.min_interval = 1  # generations are integers

        # the gang's ranks: per-rank phases, stragglers (SPEC §5.1)
        self.ranks = RankPanel(**fig)

    def update(self) -> None:
        snaps = snapshots(self.plugin)
        names = sorted(snaps)
        if self.select.options != names:
            self.select.options = names
        snap = _pick(snaps, self.select.value)
        if snap is None:
            self.summary.text = "<p>No daskdist coordinator on this scheduler yet.</p>"
            return
        if self.select.value != snap["name"]:
            self.select.value = snap["name"]
        s = snap["status"]
        self.summary.text = (
            f"<b>{snap['name']}</b>: {s['workers']} workers · done {s['done']} · "
            f"failed {s['failed']} · retried {s['retried']} · recovered {s['recovered']} · "
            f"queued {s['queued']} · running {s['running']} · "
            f"lease expiries {s.get('lease_expiries', 0)}"
            + "".join(f" · <b>{html.escape(p['worker'])}</b> preempted in "
                      f"{p['seconds_left']:.0f} s ({html.escape(p['reason'])})"
                      for p in s.get("preemptions") or ()))

        h = dict(snap["history"])
        h["time"] = _time_ms(h["time"])
        self.rates.data = h

        ws = snap["workers"]
        labels = [f"{w['index']}: {w['address']}" if w["alive"] else f"gone: {w['address']}"
                  for w in ws]
        if list(self.worker_closures.y_range.factors) != labels:
            self.worker_closures.y_range.factors = labels
        self.workers.data = {
            "worker": labels,
            "closures_per_second": [w["closures_per_second"] for w in ws],
            "rows_per_second": [w["rows_per_second"] for w in ws],
            "closures": [w["closures"] for w in ws],
            "rows": [w["rows"] for w in ws],
        }

        ds = snap["datasets"]
        names = [f"{d['name'] + ' ' if d.get('name') else ''}{d['dataset_id']} epoch "
                 f"{d['epoch']}" for d in ds]
        if list(self.dataset_bars.y_range.factors) != names:
            self.dataset_bars.y_range.factors = names
        self.datasets.data = {"dataset": names,
                              **{k: [d[k] for d in ds] for k in ("acknowledged", "leased",
                                                                 "free", "total")}}

        g = snap["group"]
        members = ", ".join(g.get("members", [])) or "none"
        self.group.text = (
            f"<b>collective group</b>: generation {g.get('generation', 0)} · "
            f"{g.get('backend', '-')} · {'formed' if g.get('formed') else 'not formed'} · "
            f"{g.get('formations', 0)} formations, {g.get('losses', 0)} members lost · "
            f"last formation {g.get('bootstrap_seconds', 0.0):.2f} s<br>members: {members}"
            f"<br>{_checkpoint_text(g.get('checkpoint'))}")
        self.ranks.update(snap.get("ranks"))
        ev = snap["events"]
        self.events.data = {
            "time": [1000.0 * e["time"] for e in ev],
            "generation": [e["generation"] for e in ev],
            "kind": [e["kind"] for e in ev],
            "label": ["lost" if e["kind"] == "loss" else f"{e['seconds']:.2f} s" for e in ev],
            "color": ["#d62728" if e["kind"] != "formed" else "#2ca02c" for e in ev],
            "marker": ["x" if e["kind"] == "loss" else "circle" for e in ev],
            "worker": [e["worker"] for e in ev],
        }

    # -- layouts -------------------------------------------------------------------------
    def full(self):
        return column(row(self.select, self.summary, sizing_mode="stretch_width"),
                      self.closures, self.backlog,
                      row(self.worker_closures, self.worker_rows, sizing_mode="stretch_width"),
                      self.ranks.layout(), self.dataset_bars, self.group, self.timeline,
                      sizing_mode="stretch_width")


def _doc(part: str, plugin: Any, extra: dict, doc: Any) -> None:
    """Build one document: ``part`` is "full" or one plot of the individual pages."""
    dash = DaskdistDashboard(plugin)
    dash.update()
    roots = {
        "full": dash.full,
        "closures": lambda: column(dash.closures, dash.backlog, sizing_mode="stretch_both"),
        "workers": lambda: row(dash.worker_closures, dash.worker_rows,
                               sizing_mode="stretch_both"),
        "datasets": lambda: dash.dataset_bars,
        "group": lambda: column(dash.group, dash.timeline, sizing_mode="stretch_both"),
        "ranks": dash.ranks.layout,
    }
    interval = int(1000 * config.seconds("dashboard.update-interval"))
    doc.add_periodic_callback(dash.update, interval)
    doc.add_root(roots[part]())
    doc.title = "Dask: daskdist" if part == "full" else f"Dask: daskdist {part}"
    if part == "full":
        try:  # Dask's page template: its navigation bar around our plots
            from distributed.dashboard.components.scheduler import env

            doc.template = env.get_template("simple.html")
            doc.template_variables.update(extra)
        except Exception as e:  # pragma: no cover - a Dask without the template
            logger.debug("daskdist: no Dask page template (%r)", e)
    try:
        from distributed.dashboard.components.scheduler import BOKEH_THEME

        doc.theme = BOKEH_THEME
    except Exception:  # pragma: no cover
        pass


def _bokeh_tornado(scheduler: Any):
    from bokeh.server.tornado import BokehTornado

    app = getattr(scheduler, "http_application", None)
    for sub in getattr(app, "applications", ()):
        if isinstance(sub, BokehTornado):
            return sub
    return None


def _add_application(bt: Any, url: str, app: Application) -> None:
    """Add ``app`` at ``url`` to a running BokehTornado, as its constructor would."""
    from bokeh.server.contexts import ApplicationContext
    from bokeh.server.tornado import create_static_handler
    from bokeh.server.urls import per_app_patterns
    from bokeh.server.views.ws import WSHandler

    app.add(DocumentLifecycleHandler())
    ctx = ApplicationContext(app, url=url, logout_url=None)
    ctx._loop = bt._loop
    routes = []
    for pattern, handler, *_ in per_app_patterns:
        context: dict[str, Any] = {"application_context": ctx}
        if issubclass(handler, WSHandler):
            context["compression_level"] = None
            context["mem_level"] = None
        routes.append((bt._prefix + url + pattern, handler, context))
    ws = next(r[0] for r in routes if r[0].endswith("/ws"))
    for r in routes:
        r[2]["bokeh_websocket_path"] = ws
    routes.append(create_static_handler(bt._prefix, url, app))
    bt._applications[url] = ctx
    bt.add_handlers(r".*", routes)
    bt._loop.add_callback(ctx.run_load_hook)


def install(plugin: Any, scheduler: Any) -> bool:
    """Add the pages to the scheduler's dashboard and its navigation; False without one."""
    bt = _bokeh_tornado(scheduler)
    if bt is None:
        return False
    extra: dict = {}
    try:
        from distributed.dashboard.scheduler import template_variables

        tv = template_variables(scheduler)  # memoized: the dict every page renders with
        if PAGE not in tv["pages"]:
            tv["pages"].append(PAGE)
            tv["plots"].extend({"url": f"individual-daskdist-{p}", "name": f"daskdist {p}"}
                               for p in PARTS)
        extra = {"prefix": bt._prefix + "/", **tv}
    except Exception as e:  # pragma: no cover - a Dask whose template differs
        logger.debug("daskdist: dashboard navigation not extended (%r)", e)
    urls = {f"/{PAGE}": "full"}
    urls.update({f"/individual-daskdist-{p}": p for p in PARTS})
    for url, part in urls.items():
        if url in bt._applications:
            continue  # idempotent: a second start on the same scheduler
        handler = FunctionHandler(functools.partial(_doc, part, plugin, extra))
        _add_application(bt, url, Application(handler))
    return True
