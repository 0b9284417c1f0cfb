"""How a closure's value leaves its worker: pickled, its tensors on the host.

A closure that returns CUDA tensors (a loss, a state dict, a batch of predictions) could
not be fetched on a client without CUDA: torch pickles a tensor with its device, and
unpickling a CUDA tensor needs CUDA. So the worker pickles every tensor that is not on
the host as its host copy, at any depth of the value (lists, dicts, a user's object),
unless ``daskdist.worker.results-to-cpu`` is false (the client has the same GPUs).
Tensors already on the host pickle as they are (no copy), and a value with no tensor
pickles as it always did: the hook is a per-type entry of the pickler's dispatch table.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from typing import Any

import cloudpickle
from distributed.protocol.pickle import dumps


def dump_result(value: Any, host: str | None = "cpu") -> bytes:
    """``value`` pickled, every tensor not on ``host`` as a copy on ``host`` (``None``:
    as they are). ``host`` is a parameter so the CPU tests can send every tensor to
    ``"meta"`` and see that each one took the hook."""
    torch = sys.modules.get("torch")
    if host is None or torch is None:  # no torch imported here: no tensor in the value
        return dumps(value)
    plain, cloud = _tables(host, torch)
    buf = io.BytesIO()
    try:
        p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        p.dispatch_table = plain
        p.dump(value)
    except Exception:  # a lambda, a local class: cloudpickle, as distributed does
        buf = io.BytesIO()
        _CloudPickler(buf, cloud).dump(value)
    return buf.getvalue()


class _CloudPickler(cloudpickle.Pickler):
    """cloudpickle with a dispatch table of its own: the C pickler reads the table when
    it is made (cloudpickle's class attribute would win over one set afterwards)."""

    def __init__(self, file: Any, table: dict) -> None:
        self.dispatch_table = table
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)


_TABLES: dict[tuple[str, int], tuple[dict, dict]] = {}


def _tables(host: str, torch: Any) -> tuple[dict, dict]:
    """The dispatch tables of pickle and cloudpickle as plain dicts (the C pickler looks
    every object's type up in them) with the tensor types' entry; made once per host
    (and again if a package registered another reducer with ``copyreg``)."""
    key = (host, len(copyreg.dispatch_table))
    tables = _TABLES.get(key)
    if tables is None:
        reduce = _to_host(host)
        made = []
        for base in (copyreg.dispatch_table, cloudpickle.Pickler.dispatch_table):
            table = dict(base.items())
            table[torch.Tensor] = table[torch.nn.Parameter] = reduce
            made.append(table)
        tables = _TABLES[key] = (made[0], made[1])
    return tables


def _to_host(host: str):
    import torch

    host_type = torch.device(host).type

    def reduce(t: Any) -> Any:
        if t.device.type != host_type:
            moved = t.detach().to(host)
            if isinstance(t, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
            else:
                moved.requires_grad_(t.requires_grad and moved.is_floating_point())
            t = moved
        return t.__reduce_ex__(2)

    return reduce
