"""Cloud preemption notices, polled on each worker: AWS spot ``instance-action``, Azure
scheduled events, GCP's ``preempted`` flag, and any registered poller.

``daskdist.preemption.pollers`` names the pollers a worker runs (none by default), each
every ``daskdist.preemption.poll-interval``, against the URL of
``daskdist.preemption.endpoints`` (the instance metadata services, which a test points
at a local fake). A name holding ``:`` is imported (``"module:attribute"``, a
:class:`Poller` or a function making one), so a site adds its own without changing
daskdist; :func:`register_poller` adds one by name (call it in a worker preload).
What a body means is pure (``core.lifetime.deadlines``); this module only fetches it.
"""

from __future__ import annotations

import importlib
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from daskdist import config
from daskdist.core.lifetime import deadlines

logger = logging.getLogger(__name__)

TIMEOUT = 2.0  # seconds one request may take (a metadata service answers in ms)


@dataclass
class Poller:
    """One source of cloud notices: GET ``url`` (with ``headers``), and ``parse(body,
    now)`` gives the deadline in epoch seconds, or ``None`` (no notice). A 404 is no
    notice (AWS answers it until there is one). ``token_url``: AWS IMDSv2's session
    token, PUT first (``None``: none)."""

    reason: str
    url: str
    parse: Callable[[str, float], float | None]
    headers: dict[str, str] = field(default_factory=dict)
    token_url: str | None = None

    def poll(self) -> float | None:
        """One request (blocking: call it in a thread): the deadline, or ``None``."""
        headers = dict(self.headers)
        if self.token_url:
            token = _request(self.token_url, {"X-aws-ec2-metadata-token-ttl-seconds": "60"},
                             "PUT")
            if token:
                headers["X-aws-ec2-metadata-token"] = token
        body = _request(self.url, headers)
        return None if body is None else self.parse(body, time.time())


def _request(url: str, headers: dict[str, str], method: str = "GET") -> str | None:
    """The body of a 200 reply, or ``None`` (any other status, or no answer)."""
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as reply:  # noqa: S310 - a configured URL
            return reply.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _endpoint(name: str) -> str | None:
    return (config.get("preemption.endpoints") or {}).get(name)


def _aws() -> Poller:
    return Poller("aws-spot", _endpoint("aws"), lambda body, now: deadlines.aws_deadline(body),
                  token_url=_endpoint("aws-token"))


def _azure() -> Poller:
    return Poller("azure-scheduled-event", _endpoint("azure"), deadlines.azure_deadline,
                  {"Metadata": "true"})


def _gcp() -> Poller:
    return Poller("gcp-preempted", _endpoint("gcp"), deadlines.gcp_deadline,
                  {"Metadata-Flavor": "Google"})


_REGISTRY: dict[str, Callable[[], Poller]] = {"aws": _aws, "azure": _azure, "gcp": _gcp}


def register_poller(name: str, make: Callable[[], Poller]) -> None:
    """Make ``name`` a poller ``daskdist.preemption.pollers`` may list: ``make()``
    builds it on the worker (reading its settings then)."""
    _REGISTRY[name] = make


def make_poller(name: str) -> Poller:
    """The poller ``name`` (registered, or ``"module:attribute"``); ``ValueError``
    naming the setting for an unknown one."""
    if ":" in name:
        module, _, attribute = name.partition(":")
        made = getattr(importlib.import_module(module), attribute)
        return made if isinstance(made, Poller) else made()
    make = _REGISTRY.get(name)
    if make is None:
        raise ValueError(f"daskdist.preemption.pollers: unknown poller {name!r} (known: "
                         f"{', '.join(sorted(_REGISTRY))}, or 'module:attribute')")
    poller = make()
    if not poller.url:
        raise ValueError(f"daskdist.preemption.endpoints.{name} is not set")
    return poller
