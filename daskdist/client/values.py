"""Client-side handles on remote work: RemoteValue, PerWorkerValues and their statuses."""

from __future__ import annotations

import html
import pickle
import threading
from enum import Enum
from typing import Any

from daskdist.core import protocol
from daskdist.errors import CancelledError, load_error


class RemoteValueStatus(str, Enum):
    """Where a scheduled closure is in its life (SPEC §2.5a)."""

    PENDING = protocol.PENDING
    RUNNING = protocol.RUNNING
    READY = protocol.READY
    FAILED = protocol.FAILED
    CANCELLED = protocol.CANCELLED


class RemoteValue:
    """The future result of one scheduled closure (TensorFlow's ``RemoteValue``)."""

    __slots__ = ("_cid", "_coordinator", "_event", "_status", "_payload", "_kind",
                 "_value", "_loaded", "attempt", "__weakref__")

    def __init__(self, cid: str, coordinator: Any = None):
        self._cid = cid
        self._coordinator = coordinator
        self._event = threading.Event()
        self._status = RemoteValueStatus.PENDING
        self._payload: Any = None
        self._kind: str | None = None
        self._value: Any = None
        self._loaded = False
        self.attempt = 0

    # set by the coordinator's result loop
    def _set(self, state: str, payload: Any, kind: str | None, attempt: int) -> None:
        if self._event.is_set():
            return  # final once
        self._status = RemoteValueStatus(state)
        self._payload = payload
        self._kind = kind
        self.attempt = attempt
        self._event.set()

    def _cancel(self, error: BaseException) -> None:
        """Cancelled with ``error`` (its coordinator closed), unless already final."""
        if self._event.is_set():
            return
        self._status = RemoteValueStatus.CANCELLED
        self._value, self._loaded = error, True
        self._event.set()

    def _load(self) -> Any:
        if not self._loaded:
            if self._status is RemoteValueStatus.READY:
                self._value = pickle.loads(self._payload)
            elif self._status is RemoteValueStatus.FAILED:
                self._value = load_error(self._payload, self._kind)
            else:
                self._value = CancelledError(
                    f"closure {self._cid} was cancelled after an earlier closure's error"
                )
            self._payload = None
            self._loaded = True
        return self._value

    def fetch(self, timeout: float | None = None) -> Any:
        """Wait for the closure; return its value or raise its error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"closure {self._cid} did not finish within {timeout} s")
        value = self._load()
        if self._status is not RemoteValueStatus.READY:
            raise value
        return value

    def done(self) -> bool:
        """Whether the closure reached a final state (non-blocking)."""
        return self._event.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the closure; its error, or ``None`` if it succeeded."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"closure {self._cid} did not finish within {timeout} s")
        if self._status is RemoteValueStatus.READY:
            return None
        return self._load()

    @property
    def status(self) -> RemoteValueStatus:
        """PENDING, RUNNING, READY, FAILED or CANCELLED (RUNNING is asked of the scheduler)."""
        if not self._event.is_set() and self._coordinator is not None:
            state = self._coordinator._closure_state(self._cid)
            if state == protocol.RUNNING and not self._event.is_set():
                return RemoteValueStatus.RUNNING
        return self._status

    def __reduce__(self):
        raise TypeError(
            "a RemoteValue cannot be passed to a closure or pickled; "
            "fetch() it on the client and pass the value instead"
        )

    def __repr__(self) -> str:
        return f"<RemoteValue {self._cid} {self._status.value}>"

    def _repr_html_(self) -> str:
        """Its state (not asking the scheduler), attempt, and a short form of the value."""
        color = {protocol.READY: "green", protocol.FAILED: "red",
                 protocol.CANCELLED: "gray"}.get(
            self._status.value, "orange")
        extra = f" · attempt {self.attempt}" if self.attempt else ""
        if self._event.is_set():
            try:
                text = repr(self._load())
            except Exception as e:  # a value that cannot be loaded here
                text = f"<unloadable: {e!r}>"
            extra += f" · <code>{html.escape(text[:200])}</code>"
        return (f"<b>RemoteValue</b> <code>{html.escape(self._cid)}</code> "
                f"<span style='color:{color}'>{self._status.value}</span>{extra}")


class PerWorkerValues:
    """One component per worker (TensorFlow's ``PerWorkerValues``).

    Either a reference to a per-worker resource (``rid``: each worker resolves it to its
    own component when the object is a closure argument), or, on the client, the
    per-worker results of a gang closure (``values``: a tuple in rank order).
    """

    __slots__ = ("rid", "kind", "values")

    def __init__(self, rid: str | None = None, kind: str = "resource",
                 values: tuple | None = None):
        if (rid is None) == (values is None):
            raise ValueError("PerWorkerValues needs exactly one of rid= or values=")
        self.rid = rid
        self.kind = kind
        self.values = None if values is None else tuple(values)

    def __next__(self):
        raise TypeError(
            "PerWorkerValues hold one component per worker and can only be used as a "
            "closure argument: pass them to Coordinator.schedule()"
        )

    def __iter__(self):
        if self.values is None:
            raise TypeError(
                "a per-worker resource has no client-side components; pass it to "
                "Coordinator.schedule() and each worker uses its own"
            )
        return iter(self.values)

    def __len__(self) -> int:
        if self.values is None:
            raise TypeError("a per-worker resource has no client-side length")
        return len(self.values)

    def __getitem__(self, i: int):
        if self.values is None:
            raise TypeError("a per-worker resource has no client-side components")
        return self.values[i]

    def __reduce__(self):
        """A closure argument travels as a :class:`~daskdist.core.protocol.ResourceRef`,
        which each worker resolves to its own component."""
        if self.values is not None:
            raise TypeError("client-side PerWorkerValues of RemoteValues cannot be pickled")
        return (protocol.ResourceRef, (self.rid, self.kind))

    def __repr__(self) -> str:
        if self.values is not None:
            return f"PerWorkerValues({list(self.values)!r})"
        return f"PerWorkerValues({self.kind} {self.rid})"
