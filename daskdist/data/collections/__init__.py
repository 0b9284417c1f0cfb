"""Dask collections (DataFrames, dicts of Arrays) as a loader's source."""
