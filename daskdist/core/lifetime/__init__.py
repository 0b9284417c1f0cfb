"""A job's life beyond its client and its workers (pure; SPEC §4.6): what the scheduler
keeps for a keep-alive owner until its client reads it (``keepalive.py``), and
preemption deadlines: what fits before one, and the cloud notices that give one
(``deadlines.py``)."""
