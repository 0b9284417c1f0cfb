"""What JupyterLab shows: HTML reprs and ``tqdm.auto`` progress bars of daskdist objects.

Client-side only (no torch import). ``Coordinator``, ``DistributedDataset``,
``RemoteValue`` and ``CollectiveGroup`` call these from their ``_repr_html_``;
``Coordinator.join(progress=True)`` and ``DistributedDataset.progress(bar=True)`` use the
bars.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

STYLE = "font-family:var(--jp-code-font-family,monospace);font-size:12px"
COLORS = {"acknowledged": "#2ca02c", "leased": "#ff7f0e", "free": "#d9d9d9"}


def _e(v: Any) -> str:
    return html.escape(str(v))


def table(rows: dict[str, Any]) -> str:
    cells = "".join(f"<tr><th style='text-align:left'>{_e(k)}</th><td style='text-align:left'>"
                    f"{v}</td></tr>" for k, v in rows.items())
    return f"<table style='{STYLE}'>{cells}</table>"


def stacked_bar(parts: dict[str, int], total: int, width: int = 320) -> str:
    """An HTML bar of ``parts`` (acknowledged / leased / free rows) out of ``total``."""
    total = max(total, 1)
    segs = "".join(
        f"<div title='{_e(k)}: {v:,}' style='width:{100 * v / total:.2f}%;"
        f"background:{COLORS.get(k, '#999')};height:100%'></div>"
        for k, v in parts.items() if v > 0)
    return (f"<div style='display:flex;width:{width}px;height:12px;border:1px solid #999'>"
            f"{segs}</div>")


def coordinator_html(coord: Any) -> str:
    try:
        s = coord.status()
    except Exception as e:
        return f"<b>daskdist Coordinator</b> {_e(coord.name)}: status unavailable ({e!r})"
    link = getattr(coord.client, "dashboard_link", None)
    rows = {
        "scheduler": _e(coord.client.scheduler.address),
        "workers": _e(s["workers"]),
        "closures": (f"{s['done']:,} done · {s['running']:,} running · {s['queued']:,} queued"
                     f" · {s['failed']} failed · {s['retried']} retried"),
        "recoveries": _e(s.get("recoveries", s.get("recovered", 0))),
        "group": (f"generation {s['group_generation']}, {s['group_size']} members"
                  if s.get("group_size") else "none"),
    }
    if link:
        base = link.rsplit("/", 1)[0]
        rows["dashboard"] = (f"<a href='{_e(base)}/daskdist-dashboard' target='_blank'>"
                             f"{_e(base)}/daskdist-dashboard</a>")
    return (f"<div><b>daskdist Coordinator</b> <code>{_e(coord.name)}</code>"
            f"{table(rows)}</div>")


def dataset_html(ds: Any) -> str:
    rows = {"shards": _e(ds.shards), "dataset id": f"<code>{_e(ds.dataset_id)}</code>",
            "epoch": _e(ds.epoch)}
    try:
        p = ds.progress()
    except Exception as e:  # not a dynamic dataset, or the scheduler is gone
        rows["progress"] = _e(f"unavailable ({type(e).__name__})")
        p = None
    if p is not None and p.get("known", True):
        parts = {k: p[k] for k in ("acknowledged", "leased", "free")}
        rows["progress"] = (stacked_bar(parts, p["total"]) +
                            f"{p['acknowledged']:,} of {p['total']:,} rows acknowledged"
                            f" · {p['leased']:,} leased · {p['free']:,} free")
    elif p is not None:
        rows["progress"] = "epoch not started (iterate it in closures)"
    return f"<div><b>daskdist DistributedDataset</b>{table(rows)}</div>"


def group_html(group: Any) -> str:
    members = "".join(f"<tr><td>{rank}</td><td><code>{_e(m)}</code></td></tr>"
                      for rank, m in enumerate(group.members))
    rows = {"backend": _e(group.backend), "world size": _e(group.world_size),
            "generation": _e(group.generation)}
    return (f"<div><b>daskdist CollectiveGroup</b>{table(rows)}"
            f"<table style='{STYLE}'><tr><th>rank</th><th>worker</th></tr>{members}</table>"
            "</div>")


def join_with_bar(name: str, unfinished: Callable[[float], tuple[int, bool]],
                  timeout: float | None) -> float | None:
    """A ``tqdm.auto`` bar of coordinator ``name``'s closures finishing, until none is
    left, an error is pending or ``timeout`` seconds passed; the seconds left of
    ``timeout`` (``None``: no timeout) for the join that follows. ``unfinished(wait)``:
    the closures left and whether an error is pending, after waiting up to ``wait``
    seconds for news while some are left."""
    from tqdm.auto import tqdm

    deadline = None if timeout is None else time.monotonic() + timeout
    total, _ = unfinished(0.0)
    with tqdm(total=total, desc=f"{name}: closures", unit="closure") as bar:
        while True:
            expired = deadline is not None and time.monotonic() >= deadline
            left, error = unfinished(0.0 if expired else 0.1)
            finished = bar.total - left
            if finished < bar.n:  # closures scheduled meanwhile: a longer bar
                bar.total += bar.n - finished
                finished = bar.n
            bar.update(finished - bar.n)
            if not left or error or (
                    deadline is not None and time.monotonic() >= deadline):
                break
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def update_epoch_bar(bar: tuple[int, Any] | None, p: dict) -> tuple[int, Any]:
    """Show ``p`` (an epoch's progress) on a dataset's ``tqdm.auto`` bar (``bar``: its
    ``(epoch, bar)`` so far, or ``None``); closes it when the epoch completes. One bar
    per dataset, replaced when the epoch changes: the ``(epoch, bar)`` to keep."""
    from tqdm.auto import tqdm

    if bar is not None and bar[0] != p["epoch"]:
        bar[1].close()
        bar = None
    if bar is None:
        bar = (p["epoch"], tqdm(total=p["total"], desc=f"epoch {p['epoch']}", unit="row",
                                unit_scale=True))
    t = bar[1]
    t.update(p["acknowledged"] - t.n)
    t.set_postfix(leased=p["leased"], free=p["free"], refresh=False)
    if p["complete"]:
        t.close()
    return bar
