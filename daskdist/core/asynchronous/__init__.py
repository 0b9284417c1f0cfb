"""One model trained asynchronously, the scheduler's pure parts (SPEC §2.8): a model's
ledger (``ledger.py``: its holder, standby, versions, the pushes waiting for durability)
and the named messages between the book, the holder, its standby and the pushing
workers, with their checks (``protocol.py``)."""
