"""Headless Chromium for the dashboard tests: load a page, wait until a probe run in it
says the page is ready, take a screenshot.

Drives Debian's headless Chromium through the DevTools protocol (a websocket: tornado's
client, already a Dask dependency). ``CHROMIUM`` is ``None`` where it is missing (the
tests skip, saying so; ``.ci/run`` installs it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params):
        self.next_id += 1
        self.ws.write_message(json.dumps({"id": self.next_id, "method": method,
                                          "params": params}))
        while True:
            msg = await asyncio.wait_for(self.ws.read_message(), 30)
            assert msg is not None, "DevTools websocket closed"
            reply = json.loads(msg)
            if reply.get("id") == self.next_id:
                assert "error" not in reply, reply
                return reply["result"]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


async def render(url: str, port: int, shot: Path, probe: str,
                 ready: Callable[[Any], bool], timeout: float = 60.0) -> Any:
    """Load ``url``, evaluate ``probe`` (JavaScript returning JSON text) until
    ``ready(its value)`` or ``timeout`` s, save a screenshot at ``shot``; the last value."""
    from tornado.websocket import websocket_connect

    targets = json.loads(_get(f"http://127.0.0.1:{port}/json/list"))
    page = next(t for t in targets if t["type"] == "page")
    ws = await websocket_connect(page["webSocketDebuggerUrl"], max_message_size=1 << 27)
    cdp = DevTools(ws)
    await cdp.call("Page.enable")
    await cdp.call("Page.navigate", url=url)
    deadline = time.monotonic() + timeout
    result = None
    while time.monotonic() < deadline:
        out = await cdp.call("Runtime.evaluate", expression=probe, returnByValue=True)
        value = out["result"].get("value")
        result = json.loads(value) if value else None
        if ready(result):
            break
        await asyncio.sleep(0.25)
    png = await cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    shot.write_bytes(base64.b64decode(png["data"]))
    ws.close()
    return result


def browse(url: str, shot: Path, probe: str, ready: Callable[[Any], bool],
           timeout: float = 60.0) -> Any:
    """:func:`render` in a headless Chromium started for it (and ended after)."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--window-size=1280,1400",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().strip()):
                assert time.monotonic() < deadline, "chromium's DevTools port never came"
                time.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            with ThreadPoolExecutor(1) as pool:  # a fresh event loop, off pytest's thread
                return pool.submit(asyncio.run, render(url, port, shot, probe, ready,
                                                       timeout)).result()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
