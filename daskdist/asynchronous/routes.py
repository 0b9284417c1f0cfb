"""The worker's handlers for asynchronous models, one table each for stream messages
(from the scheduler's book: a role) and RPCs (a pull or a push from a worker training
the model, a copy from its holder, the client's ``state_dict``). The worker plugin
installs them with its own; each is ``fn(worker, **message)``.

Loads no torch: each handler imports the holder's side when it runs.
"""

from __future__ import annotations

from typing import Any

from daskdist.core import checks
from daskdist.core.asynchronous.protocol import AsyncRole, Push


def _service(worker: Any, name: str) -> Any:
    from daskdist.asynchronous import holder

    return holder.service(worker, checks.text(name, "name"))


def role(worker: Any, name: str, role: Any) -> None:
    """The scheduler gives this worker a role for one model (holder, standby, none)."""
    _service(worker, name).on_role(checks.named(role, "daskdist-async-role", AsyncRole))


async def push(worker: Any, name: str, push: Any) -> dict:
    """A worker's delta for the model this worker holds."""
    return await _service(worker, name).push(
        checks.named(push, "daskdist_async_push", Push))


async def pull(worker: Any, name: str, model: str, incarnation: int,
               version: int) -> Any:
    """The global model this worker holds, unless the caller has ``(incarnation,
    version)`` already."""
    return await _service(worker, name).pull(checks.text(model, "model"), incarnation,
                                             version)


def copy(worker: Any, name: str, model: str, incarnation: int, version: int, blob: bytes,
         applied: list) -> Any:
    """The holder's state for this worker's standby copy."""
    return _service(worker, name).copy(checks.text(model, "model"), incarnation, version,
                                       blob, checks.items(applied, "applied"))


ASYNC_STREAM_ROUTES = {"daskdist-async-role": role}
ASYNC_RPC_ROUTES = {
    "daskdist_async_push": push,
    "daskdist_async_pull": pull,
    "daskdist_async_copy": copy,
}
