"""The worker side: the worker plugin (``plugin``), its pull loop, closure threads and
results (``runner``), and the scheduler services a closure reaches through its context,
with the session's life (``services``); per-worker resources are built by
:class:`daskdist.session.resources.ResourceRegistry`. torch is imported lazily (device binding)."""
