"""The dashboard's per-rank panel (SPEC §5.1): each gang member's mean step split into
data, collective, commit and compute, stragglers marked in red with their cause, and a
line saying what holds the gang back.

Part of the daskdist Bokeh pages (:mod:`daskdist.plugins.scheduler.web.dashboard`): it reads
the ``"ranks"`` part of a coordinator's snapshot (the rank book's report of the
stragglers and the slowest ranks, ``stats.TOP_RANKS`` at most) and changes nothing.
"""

from __future__ import annotations

import html
from typing import Any

from bokeh.layouts import column
from bokeh.models import ColumnDataSource, Div, FactorRange, HoverTool
from bokeh.plotting import figure

PHASES = ("data", "collective", "commit", "compute")
COLORS = {"data": "#1f77b4", "collective": "#ff7f0e", "commit": "#9467bd",
          "compute": "#2ca02c"}
STRAGGLER = "#d62728"


def _label(r: dict, slow: dict) -> str:
    s = slow.get(r["rank"])
    mark = f"  ⚠ straggler ({s['cause']})" if s else ""
    return f"rank {r['rank']} · {r['worker']}{mark}"


class RankPanel:
    """A summary line and a stacked bar per rank; :meth:`update` from a snapshot."""

    def __init__(self, **fig: Any) -> None:
        self.summary = Div(text="", sizing_mode="stretch_width")
        self.source = ColumnDataSource({k: [] for k in (
            "rank", *PHASES, "total", "outline", "steps", "median", "p90",
            "rows_per_second", "data_share")})
        hover = HoverTool(tooltips=[("", "@rank"), ("steps", "@steps"),
                                    ("step ms (median, p90)", "@median{0.0}, @p90{0.0}"),
                                    *[(f"{p} ms", f"@{p}{{0.0}}") for p in PHASES],
                                    ("data share", "@data_share{0%}"),
                                    ("rows/s", "@rows_per_second{0,0}")])
        self.figure = figure(title="Gang ranks: mean step (ms) by phase, stragglers in red",
                             y_range=FactorRange(), height=260, tools=[hover, "save"],
                             name="daskdist-ranks", **fig)
        self.figure.hbar_stack(list(PHASES), y="rank", height=0.7, source=self.source,
                               color=[COLORS[p] for p in PHASES],
                               legend_label=list(PHASES))
        # a straggler's whole bar outlined in red (its name says why on the axis)
        self.figure.hbar(y="rank", left=0, right="total", height=0.8, source=self.source,
                         fill_alpha=0.0, line_color=STRAGGLER, line_width=3,
                         line_alpha="outline")
        self.figure.x_range.start = 0
        self.figure.xaxis.axis_label = "ms a step"
        legend = self.figure.legend[0]
        legend.orientation = "horizontal"
        self.figure.add_layout(legend, "below")  # beside no bar

    def layout(self) -> Any:
        return column(self.summary, self.figure, sizing_mode="stretch_width")

    def update(self, report: dict | None) -> None:
        report = report or {}
        ranks, stragglers = report.get("ranks") or [], report.get("stragglers") or []
        slow = {s["rank"]: s for s in stragglers}
        labels = [_label(r, slow) for r in ranks]
        if list(self.figure.y_range.factors) != labels:
            self.figure.y_range.factors = labels
            self.figure.height = max(260, 140 + 40 * len(labels))  # a bar a rank
        ms = {p: [1e3 * r["phases"][p] for r in ranks] for p in PHASES}
        self.source.data = {
            "rank": labels, **ms,
            "total": [sum(ms[p][i] for p in PHASES) for i in range(len(ranks))],
            "outline": [1.0 if r["rank"] in slow else 0.0 for r in ranks],
            "steps": [r["steps"] for r in ranks],
            "median": [1e3 * r["step_seconds"]["median"] for r in ranks],
            "p90": [1e3 * r["step_seconds"]["p90"] for r in ranks],
            "rows_per_second": [r["rows_per_second"] for r in ranks],
            "data_share": [r["data_share"] for r in ranks],
        }
        self.summary.text = _summary(report, ranks, stragglers)


def _summary(report: dict, ranks: list, stragglers: list) -> str:
    if not ranks:
        return "<b>gang ranks</b>: no gang member has reported yet"
    parts = [f"<b>gang ranks</b>: {len(ranks)} shown · windows of "
             f"{report.get('window', 0):g} s"]
    for s in stragglers:
        parts.append(f"<span style='color:{STRAGGLER}'><b>straggler</b> rank {s['rank']} "
                     f"({html.escape(s['worker'])}): {1e3 * s['own_seconds']:.1f} ms a step "
                     f"against the median {1e3 * s['median_seconds']:.1f} ms; cause: "
                     f"{html.escape(s['cause'])}</span>")
    if report.get("bottleneck") == "data":
        parts.append("<b>bottleneck: data</b> (most ranks wait on their input half the "
                     "step or more)")
    if report.get("stacks"):
        parts.append(f"stacks of {len(report['stacks'])} ranks collected (see "
                     "status.json)")
    return " · ".join(parts)
