"""One model trained asynchronously, on the scheduler (SPEC §2.8): the book of a
coordinator's models and its routes (``book.py``), and what a model's ledger asks of
the dynamic datasets' rows (``rows.py``)."""
