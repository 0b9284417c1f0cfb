"""Parquet and Arrow IPC files as a loader's source."""
