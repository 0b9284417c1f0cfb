"""Training loops people already have, on daskdist's gangs (SPEC §4.4).

- :mod:`daskdist.integrations.lightning`: ``DaskdistStrategy`` for ``lightning.Trainer``
  (``pip install daskdist[lightning]``).
- :mod:`daskdist.integrations.transformers`: ``prepare_trainer`` and
  ``DaskdistCallback`` for ``transformers.Trainer`` (``pip install daskdist[hf]``).

Import the submodule you use: this package imports neither framework, and
``import daskdist`` imports this package not at all.
"""
