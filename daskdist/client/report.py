"""``coord.report()``: where each gang member's step time goes (SPEC §5.1), as a value.

A :class:`Report` holds what the scheduler answered: a row a rank (steps, step time,
the split into data, collective, commit and compute, data share, rows/s, GPU), the
stragglers, whether the input pipeline is the bottleneck, and the stacks of the last
collection (kept until the next step). ``to_dict()`` is SPEC §5.1's shape,
``to_pandas()`` a row a rank, and in JupyterLab it shows as a table with a bar per rank.

Client-side only: no torch, no Dask import.
"""

from __future__ import annotations

import copy
import html
from typing import Any

from daskdist.client.reprs import STYLE

PHASES = ("data", "collective", "commit", "compute")
COLORS = {"data": "#1f77b4", "collective": "#ff7f0e", "commit": "#9467bd",
          "compute": "#2ca02c"}


def _lists(x: Any) -> Any:
    """``x`` with the wire's tuples as lists (the scheduler sends lists)."""
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    return x


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


class Report:
    """Per-rank phases, stragglers, the data bottleneck and hang stacks of a coordinator's
    gang (SPEC §5.1). ``window``: the length of the windows the figures span (seconds;
    the step times and phases are over the last 3 of them, the data share over the last)."""

    def __init__(self, data: dict, window: float = 0.0, name: str = "") -> None:
        data = _lists(data)
        self.ranks: list[dict] = list(data.get("ranks") or [])
        self.stragglers: list[dict] = list(data.get("stragglers") or [])
        self.bottleneck: str | None = data.get("bottleneck")
        stacks = data.get("stacks")
        self.stacks: dict[int, str] | None = (
            {int(k): str(v) for k, v in stacks.items()} if stacks else None)
        self.window = float(window)
        self.name = name

    def to_dict(self) -> dict[str, Any]:
        """``{"ranks": [...], "stragglers": [...], "bottleneck": "data" | None,
        "stacks": {rank: stack} | None}`` (a copy)."""
        return copy.deepcopy({"ranks": self.ranks, "stragglers": self.stragglers,
                              "bottleneck": self.bottleneck, "stacks": self.stacks})

    def to_pandas(self) -> Any:
        """A ``pandas.DataFrame`` with a row a rank: its figures flattened
        (``step_median``, ``step_p90``, a column per phase), whether it is a straggler
        and why (``straggler``, ``cause``)."""
        import pandas as pd

        slow = {s["rank"]: s for s in self.stragglers}
        rows = []
        for r in self.ranks:
            row = {"rank": r["rank"], "worker": r["worker"], "steps": r["steps"],
                   "step_median": r["step_seconds"]["median"],
                   "step_p90": r["step_seconds"]["p90"],
                   **{p: r["phases"][p] for p in PHASES},
                   "data_share": r["data_share"], "rows_per_second": r["rows_per_second"],
                   "data_source": r.get("data_source"),
                   "straggler": r["rank"] in slow,
                   "cause": slow[r["rank"]]["cause"] if r["rank"] in slow else None}
            for k, v in (r.get("gpu") or {}).items():
                row[f"gpu_{k}"] = v
            rows.append(row)
        return pd.DataFrame(rows).set_index("rank") if rows else pd.DataFrame(rows)

    # -- how it shows -------------------------------------------------------------------
    def summary(self) -> str:
        """One line: the stragglers and the bottleneck, or that there is neither."""
        parts = [f"rank {s['rank']} ({s['worker']}) is a straggler: {s['own_seconds']:.3g} s "
                 f"a step against the median {s['median_seconds']:.3g} s; cause: "
                 f"{s['cause']}" for s in self.stragglers]
        if self.bottleneck == "data":
            sources = {r.get("data_source") for r in self.ranks} - {None}
            how = (" (partitions waited for while Dask computes them)" if sources ==
                   {"computing"} else " (partitions being read)" if sources == {"reading"}
                   else "")
            parts.append(f"the input pipeline is the bottleneck: most ranks wait on data "
                         f"half their step time or more{how}")
        if not self.ranks:
            return "no gang member has reported a window yet"
        return "; ".join(parts) if parts else "no straggler, no data bottleneck"

    def __repr__(self) -> str:
        lines = [f"<daskdist Report {self.name!r}: {self.summary()}>"]
        for r in self.ranks:
            ph = " ".join(f"{p} {_ms(r['phases'][p])}" for p in PHASES)
            lines.append(f"  rank {r['rank']} {r['worker']}: {r['steps']} steps, median "
                         f"{_ms(r['step_seconds']['median'])} ms ({ph} ms), "
                         f"{r['rows_per_second']:.0f} rows/s")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        e = html.escape
        slow = {s["rank"]: s for s in self.stragglers}
        head = "".join(f"<th>{e(h)}</th>" for h in (
            "rank", "worker", "steps", "step ms (median / p90)", *[f"{p} ms" for p in PHASES],
            "data share", "rows/s", "GPU", "", "where the step goes"))
        longest = max((sum(r["phases"].values()) for r in self.ranks), default=0.0) or 1.0
        body = []
        for r in self.ranks:
            s = slow.get(r["rank"])
            gpu = r.get("gpu") or {}
            gpu_text = (f"{gpu.get('utilization')} % · {(gpu.get('memory_used') or 0) / 2**30:.1f}"
                        " GiB" if gpu else "")
            mark = (f"<b style='color:#d62728'>straggler ({e(s['cause'])})</b>" if s else "")
            cells = [str(r["rank"]), e(r["worker"]), f"{r['steps']:,}",
                     f"{_ms(r['step_seconds']['median'])} / {_ms(r['step_seconds']['p90'])}",
                     *[_ms(r["phases"][p]) for p in PHASES], f"{r['data_share']:.0%}",
                     f"{r['rows_per_second']:,.0f}", e(gpu_text), mark,
                     _bar(r["phases"], longest)]
            style = " style='background:#fde0e0'" if s else ""
            body.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        legend = " ".join(f"<span style='color:{COLORS[p]}'>&#9632;</span> {p}"
                          for p in PHASES)
        stacks = ""
        if self.stacks:
            stacks = "".join(f"<details><summary>rank {r} stack</summary><pre>{e(t)}</pre>"
                             "</details>" for r, t in sorted(self.stacks.items()))
        return (f"<div style='{STYLE}'><b>daskdist report</b> <code>{e(self.name)}</code>: "
                f"{e(self.summary())}<table><tr>{head}</tr>{''.join(body)}</table>"
                f"<div>{legend} (mean a step over the last windows of {self.window:g} s)"
                f"</div>{stacks}</div>")


def _bar(phases: dict[str, float], longest: float, width: int = 240) -> str:
    """An SVG bar of a rank's mean step split into its phases, to scale across ranks."""
    x, rects = 0.0, []
    for p in PHASES:
        w = width * phases.get(p, 0.0) / longest
        if w > 0:
            rects.append(f"<rect x='{x:.1f}' y='0' width='{w:.1f}' height='12' "
                         f"fill='{COLORS[p]}'><title>{p}: {_ms(phases[p])} ms</title></rect>")
            x += w
    return f"<svg width='{width}' height='12'>{''.join(rects)}</svg>"
