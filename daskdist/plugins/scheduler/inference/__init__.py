"""Batch-inference jobs on the scheduler (``Coordinator.map_batches``, SPEC §7): the
book that drives them and its routes (book.py), a job as the book holds it and its
messages checked (jobs.py)."""
