"""What the user hears without asking (SPEC §5.1): the scheduler's notices of a
coordinator's gang (a straggler episode began, the gang hung) logged as one WARNING each
on the ``daskdist.observe`` logger, a child of ``daskdist``.

:class:`NoticeListener` long-polls ``daskdist_rank_notices`` on the client's event loop
from the coordinator's first gang until it closes: the scheduler answers when
a notice is posted or after its poll interval, so an idle client costs next to nothing.
It hears the notices posted from its start on, never older ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from distributed.comm.core import CommClosedError

logger = logging.getLogger("daskdist.observe")


class NoticeListener:
    """Logs the notices of coordinator ``name`` (see the module) through ``rpc`` (the
    scheduler's, on ``client``'s event loop) while ``is_open()``. ``start`` from any
    thread."""

    def __init__(self, client: Any, name: str, rpc: Any, is_open: Callable[[], bool]) -> None:
        self.client = client
        self.name = name
        self.rpc = rpc
        self.is_open = is_open
        self.started = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.client.loop.add_callback(self._loop)

    def _open(self) -> bool:
        return self.is_open() and self.client.status not in ("closing", "closed")

    async def _loop(self) -> None:
        """Until the coordinator closes: each notice once, as a WARNING."""
        name, since = self.name, None
        while self._open():
            try:
                reply = await self.rpc.daskdist_rank_notices(name=name, since=since)
            except (OSError, CommClosedError):
                await asyncio.sleep(0.5)  # the scheduler is away: ask again
                continue
            except Exception as e:  # noqa: BLE001 - its coordinator closed: nothing more comes
                logger.debug("daskdist[%s]: notices stopped: %r", name, e)
                return
            if not isinstance(reply, dict) or reply.get("closed") or not self._open():
                return
            for notice in reply.get("items") or ():
                logger.warning("daskdist[%s]: %s", name, notice.get("message", notice))
            since = int(reply.get("seq", since or 0))
