"""What the scheduler serves: daskdist's Bokeh dashboard pages, ``/daskdist``,
``/daskdist/status.json`` and ``/metrics``."""
