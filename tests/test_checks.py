"""The scheduler checks who calls and what (SPEC §2.5b): handlers
refuse bad arguments with an error naming them, a client acts only as an owner it
created, a worker only with its own session, and settings are range-checked on the
client and on the scheduler. On a real LocalCluster with worker processes."""

from __future__ import annotations

import pytest
from distributed import Client

import daskdist as dd
from daskdist.core import checks, protocol
from tests.conftest import live_session, wait_until


def square(x):
    return x * x


def where(i):
    return dd.get_worker_context().address


def call(client, op, **kwargs):
    """Call a scheduler handler directly, as any client could."""
    return client.sync(getattr(client.scheduler, op), **kwargs)


def coordinators(client):
    return client.run_on_scheduler(
        lambda dask_scheduler: sorted(dask_scheduler.extensions["daskdist"].coordinators))


def test_a_client_cannot_register_as_a_worker(client, coord):
    """Only the worker at an address registers sessions for it: a forged register is
    refused and the worker's real session goes on (it is not ended)."""
    joins = coord.status()["worker_joins"]
    victim = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
    with pytest.raises(PermissionError, match="did not confirm"):
        call(client, "daskdist_register", name=coord.name, session="forged",
             address=victim, slots=1)
    with pytest.raises(PermissionError, match="not a worker"):
        call(client, "daskdist_register", name=coord.name, session="forged2",
             address="tcp://10.255.255.1:1", slots=1)
    assert coord.status()["worker_joins"] == joins and coord.status()["workers"] == 2
    wait_until(lambda: victim in coord.fetch(
        [coord.schedule(where, args=(i,)) for i in range(10)]), 30, "the victim's work")
    assert coord.status()["worker_joins"] == joins


def test_a_client_acts_only_as_its_own_owner(cluster, client, coord):
    """Another client cannot put under this owner (nor under its ids with its own
    token), so this owner's schedule never gets another's payload."""
    with Client(cluster) as other_client:
        other = dd.Coordinator(other_client, name=coord.name)
        try:
            bad = [(f"{coord._owner}-0", [b"not a pickle", None], 0)]
            with pytest.raises(PermissionError, match="not owner"):
                call(other_client, "daskdist_put", name=coord.name, owner=coord._owner,
                     token=other._token, closures=bad)
            with pytest.raises(PermissionError, match="not one of owner"):
                call(other_client, "daskdist_put", name=coord.name, owner=other._owner,
                     token=other._token, closures=bad)
            with pytest.raises(PermissionError):
                call(other_client, "daskdist_detach", name=coord.name, owner=coord._owner,
                     token=other._token)
            with pytest.raises(PermissionError):
                call(other_client, "daskdist_raise", name=coord.name, owner=coord._owner,
                     token="0" * 32)
            assert coord.schedule(square, args=(7,)).fetch(timeout=30) == 49  # cid -0
            assert other.schedule(square, args=(3,)).fetch(timeout=30) == 9
        finally:
            other.close()


def test_bad_arguments_are_refused_naming_them_and_change_nothing(client, coord):
    before = coord.status()["scheduled"]
    owner = {"name": coord.name, "owner": coord._owner, "token": coord._token}
    with pytest.raises(TypeError, match="closures must be a list"):
        call(client, "daskdist_put", closures="x", **owner)
    with pytest.raises(ValueError, match=f"at most {checks.MAX_ITEMS} items"):
        call(client, "daskdist_put", closures=[None] * (checks.MAX_ITEMS + 1), **owner)
    good = (f"{coord._owner}-900000", [b"", None], 0)
    with pytest.raises(TypeError, match=r"closures\[1\].payload"):
        call(client, "daskdist_put", closures=[good, (f"{coord._owner}-900001", "x", 0)],
             **owner)
    with pytest.raises(ValueError, match=r"closures\[0\].retries"):
        call(client, "daskdist_put", closures=[(good[0], good[1], -1)], **owner)
    with pytest.raises(TypeError, match="ack must be an int"):
        call(client, "daskdist_results", ack="0", **owner)
    with pytest.raises(ValueError, match="backend"):
        call(client, "daskdist_group_form", backend="mpi", **owner)
    with pytest.raises(TypeError, match="name must be a str"):
        call(client, "daskdist_status", name=["x"])
    # a worker's route checks its session first (a session that ended is told so), then
    # its arguments
    assert call(client, "daskdist_exchange", name=coord.name, session="s", results=[],
                held=[], want="many", block=False) == protocol.SESSION_ENDED
    live = live_session(client, coord.name)
    with pytest.raises(TypeError, match="want must be an int"):
        call(client, "daskdist_exchange", name=coord.name, session=live, results=[],
             held=[], want="many", block=False)
    assert coord.status()["scheduled"] == before  # nothing queued by a refused batch
    assert coord.schedule(square, args=(5,)).fetch(timeout=30) == 25


def test_checks_name_the_argument_and_what_it_got():
    """The one set of argument checks (core/checks.py) every handler runs: the error
    names the argument and what it got (pure)."""
    assert checks.text("d", "dataset_id") == "d" and checks.text("", "label", empty=True) == ""
    for value, exc, match in [
            (3, TypeError, "dataset_id must be a str, got int 3"),
            ("", ValueError, "dataset_id must be a non-empty str .* got 0 characters"),
            ("x" * 600, ValueError, f"at most {checks.MAX_TEXT} characters, got 600")]:
        with pytest.raises(exc, match=match):
            checks.text(value, "dataset_id")
    assert checks.integer(3, "epoch", 0, 5) == 3
    for value, exc in [(True, TypeError), (3.0, TypeError), ("3", TypeError), (6, ValueError),
                       (-1, ValueError)]:
        with pytest.raises(exc, match="epoch"):
            checks.integer(value, "epoch", 0, 5)
    assert checks.pairs([[1, 2], (3, 4)], "ranges", 2) == [(1, 2), (3, 4)]
    for value, exc, match in [
            ({1: 2}, TypeError, "ranges must be a list, got dict"),
            ([[1, 2]] * 3, ValueError, "ranges must hold at most 2 items, got 3"),
            ([[1, 2], [1]], TypeError, r"ranges\[1\] must be a pair"),
            ([[1, "2"]], TypeError, r"ranges\[0\]\[1\] must be an int, got str '2'"),
            ([[1, True]], TypeError, r"ranges\[0\]\[1\] must be an int, got bool"),
            ([[-1, 2]], ValueError, r"ranges\[0\]\[0\] must be between 0 and"),
            ([[0, 1 << 60]], ValueError, r"ranges\[0\]\[1\] must be between 0 and")]:
        with pytest.raises(exc, match=match):
            checks.pairs(value, "ranges", 2)
    from daskdist.core.protocol import DatasetDef

    fields = len(DatasetDef._fields)
    d = checks.named(["d"] + [None] * (fields - 1), "dataset", DatasetDef)
    assert isinstance(d, DatasetDef) and d.dataset_id == "d"
    for value in (["d"] * (fields - 1), "d" * fields, None):
        with pytest.raises(TypeError, match=r"dataset must be a DatasetDef \('dataset_id'"):
            checks.named(value, "dataset", DatasetDef)


def test_read_only_handlers_never_create_state(client, coord):
    # coord: the scheduler plugin is there (also when this test runs alone)
    for op, kwargs in [("daskdist_status", {}), ("daskdist_group_info", {}),
                       ("daskdist_closure_state", {"cid": "x-1"}), ("daskdist_members", {})]:
        with pytest.raises(KeyError, match="no daskdist coordinator named 'nobody'"):
            call(client, op, name="nobody", **kwargs)
    assert call(client, "daskdist_results", name="nobody", owner="o", token="t",
                ack=0) == {"detached": True}
    # a worker session's call after its coordinator closed: that session ended (no error
    # logged on the scheduler)
    assert call(client, "daskdist_get_resource", name="nobody", session="s",
                rid="resource-x") is None
    assert "nobody" not in coordinators(client)


@pytest.mark.parametrize("kwargs, error", [
    ({"max_worker_failures": 0}, ValueError),
    ({"max_worker_failures": checks.MAX_WORKER_FAILURES + 1}, ValueError),
    ({"max_worker_failures": 2.5}, TypeError),
    ({"max_worker_failures": True}, TypeError),
    ({"lease_timeout": 0}, ValueError),
    ({"lease_timeout": -1.0}, ValueError),
    ({"lease_timeout": float("inf")}, ValueError),
    ({"lease_timeout": checks.MAX_LEASE_TIMEOUT * 2}, ValueError),
    ({"lease_timeout": "30s"}, TypeError),
    ({"members": "gpus"}, ValueError),
    ({"members": 1}, TypeError),
])
def test_settings_are_range_checked_on_the_client_and_the_scheduler(client, coord, kwargs,
                                                                    error):
    (arg,) = kwargs
    with pytest.raises(error, match=arg):
        dd.Coordinator(client, name="bad-settings", **kwargs)
    with pytest.raises(error, match=arg):
        call(client, "daskdist_create", name="bad-settings", **kwargs)
    assert "bad-settings" not in coordinators(client)


def ask_a_silent_scheduler(dask_worker, name: str) -> tuple[str, float]:
    """As this worker's session: a call the scheduler never answers, with a 1 s
    ``daskdist.worker.rpc-timeout`` (from a thread: not the worker's event loop)."""
    import threading
    import time

    import dask

    from daskdist.plugins.worker.services import SessionServices

    out = []

    def ask():
        with dask.config.set({"daskdist.worker.rpc-timeout": "1s"}):
            services = SessionServices(dask_worker, name, "probe-session")
        t0 = time.monotonic()
        try:
            services._call("daskdist_test_silent")
            out.append(("answered", 0.0))
        except TimeoutError as e:
            out.append((str(e), time.monotonic() - t0))

    t = threading.Thread(target=ask)
    t.start()
    t.join(60)
    return out[0] if out else ("still waiting", 60.0)


def test_a_workers_wait_for_the_scheduler_ends(client, coord):
    """A worker's call to the scheduler that gets no reply ends after
    ``daskdist.worker.rpc-timeout`` with a TimeoutError naming the call, never waiting as
    long as the scheduler stays silent."""
    def install(dask_scheduler):
        import asyncio

        async def silent(**kwargs):
            await asyncio.sleep(30)

        dask_scheduler.handlers["daskdist_test_silent"] = silent

    client.run_on_scheduler(install)
    (what, waited), = client.run(ask_a_silent_scheduler, name=coord.name,
                                 workers=[sorted(client.scheduler_info()["workers"])[0]]
                                 ).values()
    assert "daskdist_test_silent got no reply" in what and "rpc-timeout" in what
    assert 0.9 <= waited < 10
