"""A job's life beyond its client and its workers, on the scheduler (SPEC §4.6): the
keep book (``keepalive.py``: owners whose work outlives their client, and attaching to
one) and the preemption book (``preemptions.py``: workers' deadlines)."""
