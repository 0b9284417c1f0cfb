"""Batch inference over Dask collections and files (``Coordinator.map_batches``, SPEC §7):
the worker's side of a job and its output.

- :mod:`.job`: what a job sends its workers (the engine's factory) and its closures;
- :mod:`.engine`: a member's engine (the model, built once per worker), one unit's run;
- :mod:`.feed`: units leased, read and converted ahead of the closures;
- :mod:`.outputs`: ``predict``'s output as Arrow, written off the predict thread;
- :mod:`.storage`: the output on any fsspec filesystem: staging, commits, the ledger,
  the manifest and ``_SUCCESS``, resuming;
- :mod:`.units`: how a unit names itself.

The scheduler's half is ``plugins/scheduler/inference/`` (it drives the job), the
commit rules ``core/inference.py`` (pure), the client's job handle
``client/inference.py``. Imported on the workers and, for the output's layout, by the
client; never by the scheduler.
"""
