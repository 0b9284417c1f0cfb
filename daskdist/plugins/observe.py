"""Observability on the scheduler: a ``/daskdist`` dashboard page and Prometheus metrics.

Both read the coordinators' ``status()``; nothing here changes state. Installed by the
scheduler plugin when the scheduler serves HTTP (its dashboard); the metrics join the
scheduler's own ``/metrics`` when ``prometheus_client`` is installed.
"""

from __future__ import annotations

import html
from typing import Any

from tornado.web import RequestHandler

COUNTERS = ("scheduled", "done", "failed", "retried", "cancelled", "recovered")
GAUGES = ("queued", "running", "workers", "group_generation", "group_size")


class StatusPage(RequestHandler):
    """One table per coordinator, refreshed every two seconds."""

    def initialize(self, plugin: Any) -> None:
        self.plugin = plugin

    def get(self) -> None:
        parts = ["<html><head><title>daskdist</title>",
                 "<meta http-equiv='refresh' content='2'></head><body>",
                 "<h2>daskdist coordinators</h2>"]
        for name, co in sorted(self.plugin.coordinators.items()):
            rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td>"
                           "</tr>" for k, v in co.status().items())
            parts.append(f"<h3>{html.escape(name)}</h3><table border='1'>{rows}</table>")
        if not self.plugin.coordinators:
            parts.append("<p>No coordinator yet.</p>")
        parts.append("</body></html>")
        self.set_header("Content-Type", "text/html")
        self.write("".join(parts))


class MetricsCollector:
    """``daskdist_closures_<counter>_total`` and ``daskdist_<gauge>`` per coordinator."""

    def __init__(self, plugin: Any):
        self.plugin = plugin

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families = {}
        for key in COUNTERS:
            families[key] = CounterMetricFamily(
                f"daskdist_closures_{key}", f"Closures {key}, per coordinator",
                labels=["coordinator"])
        for key in GAUGES:
            families[key] = GaugeMetricFamily(
                f"daskdist_{key}", f"{key.replace('_', ' ')}, per coordinator",
                labels=["coordinator"])
        for name, co in self.plugin.coordinators.items():
            status = co.status()
            for key, family in families.items():
                family.add_metric([name], status[key])
        yield from families.values()


_collector: MetricsCollector | None = None


def install(plugin: Any, scheduler: Any) -> None:
    """Add the page to the scheduler's HTTP server and the metrics to Prometheus."""
    global _collector
    app = getattr(scheduler, "http_application", None)
    if app is not None:
        app.add_handlers(r".*", [(r"/daskdist", StatusPage, {"plugin": plugin})])
    try:
        import prometheus_client
    except ImportError:
        return
    if _collector is None:
        _collector = MetricsCollector(plugin)
        prometheus_client.REGISTRY.register(_collector)
    else:
        _collector.plugin = plugin  # a later scheduler in the same process
