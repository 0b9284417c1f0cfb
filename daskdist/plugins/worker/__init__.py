"""The worker side: the worker plugin (``plugin``), its pull loop (``runner``), the
per-worker resources (``resources``) and the scheduler services a closure reaches
through its context (``services``). torch is imported lazily (device binding)."""
