"""The client side: ``Coordinator``, its values and datasets, and their Jupyter reprs.

Talks to the scheduler plugin only through its RPC handlers and never imports the
scheduler side (``daskdist.plugins.scheduler``) or torch at import time.
"""
