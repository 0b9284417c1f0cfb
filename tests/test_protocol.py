"""The wire's named types (plugins/protocol.py): msgpack and pickle round trips, lease
tokens parsed or refused, and the module's purity."""

from __future__ import annotations

import pickle

import pytest
from distributed.protocol import dumps, loads

from daskdist.client.closures import RemoteValueStatus
from daskdist.core import protocol
from daskdist.core.protocol import (
    CANCELLED,
    FAILED,
    LEASE_TOKEN,
    PENDING,
    READY,
    UNSTARTED,
    USER_ERROR,
    Dispatch,
    LeaseToken,
    Outcome,
    ResourceRef,
    Submission,
)

SAMPLES = [
    Submission("o-1", [b"fn", b"args"], 2),
    Dispatch("o-1", [b"fn", None], 1, True),
    Outcome("o-1", READY, b"value", None, 1,
            tokens=[LeaseToken.of("ds", 3, [(0, 4), (8, 9)])]),
    Outcome("o-1", FAILED, b"err", USER_ERROR, 2, "owner-a"),
    Outcome("g-1", READY, [b"r0", b"r1"], None, 1, "owner-b"),
    Outcome("o-2", PENDING, None, UNSTARTED, 1),
    ResourceRef("resource-abc", "resource"),
    LeaseToken.of("ds", 0, [(0, 1)]),
]


def _plain(x):
    """Tuples as lists, recursively: what msgpack makes of them."""
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_msgpack_round_trip_as_the_rpc_does(msg):
    back = loads(dumps({"op": "x", "items": [msg]}))["items"][0]
    assert type(back) in (list, tuple)  # plain on the wire, as the old tuples were
    rebuilt = type(msg)._make(back)
    assert _plain(rebuilt) == _plain(msg)
    assert rebuilt._fields == msg._fields


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_pickle_round_trip_keeps_the_type(msg):
    back = pickle.loads(pickle.dumps(msg))
    assert type(back) is type(msg) and back == msg


def test_named_types_equal_their_positional_tuples():
    assert Outcome("c", CANCELLED) == ("c", "CANCELLED", None, None, 0, "", ())
    assert LeaseToken.of("ds", "2", [(0, 3)]) == ("lease", "ds", 2, [(0, 3)])
    cid, state, payload, kind, attempt = Outcome("c", READY, b"v", None, 1)[:5]
    assert (cid, state, attempt) == ("c", READY, 1)


def test_a_per_worker_value_travels_as_a_resource_ref():
    """What a worker unpickles from a closure's arguments: a named reference, never the
    client's class (a worker resolves it to its own component)."""
    from daskdist.client.closures import PerWorkerValues

    back = pickle.loads(pickle.dumps(([PerWorkerValues("resource-1", "dataset")], {})))
    assert back == ([ResourceRef("resource-1", "dataset")], {})
    assert type(back[0][0]) is ResourceRef


def test_lease_token_parse_after_the_wire():
    tok = LeaseToken.of("ds", 1, [(0, 4), (6, 7)])
    back = loads(dumps({"t": tok}))["t"]
    assert LeaseToken.parse(back) == LeaseToken(LEASE_TOKEN, "ds", 1, [(0, 4), (6, 7)])
    assert LeaseToken.parse(back).ranges == [(0, 4), (6, 7)]  # pairs again


@pytest.mark.parametrize("other", ["not a token", ("other", 1), [], None, 5, ("x", "ds", 0, [])])
def test_lease_token_parse_ignores_other_tokens(other):
    assert LeaseToken.parse(other) is None


@pytest.mark.parametrize("bad", [("lease", "ds", 0), ("lease", "ds", "x", [(0, 1)]),
                                 ("lease", "ds", 0, [(0,)]), ("lease", "ds", 0, 5)])
def test_malformed_lease_token_raises_naming_it(bad):
    with pytest.raises(ValueError, match="malformed lease token"):
        LeaseToken.parse(bad)


def test_remote_value_status_equals_the_closure_states():
    for state in ("PENDING", "RUNNING", "READY", "FAILED", "CANCELLED"):
        assert RemoteValueStatus(getattr(protocol, state)).value == state
        assert RemoteValueStatus[state] == getattr(protocol, state)


def test_dataset_messages_travel_as_lists():
    from daskdist.core.protocol import DatasetDef, EpochLedger

    # the dataset messages travel as plain lists (msgpack) and are rebuilt by name
    d = DatasetDef("rid", "train", [(100, 3)])
    assert DatasetDef._make(list(d)) == d
    led = EpochLedger._make(["rid", 2, [[0, 5]], 10, [[50, 2], [-1, 3]]])
    assert led.acknowledged == [[0, 5]] and led.lengths == [[50, 2], [-1, 3]]
    assert EpochLedger("rid", 2, [], 10).lengths is None  # files: no lengths to carry
