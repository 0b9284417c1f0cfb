"""The collection examples, run at a small size on real LocalClusters (2 threads per
worker): the tabular ETL + MLP with async closures, the images with a CNN, sync
training and a SIGKILL mid-epoch, a GPT sharded with FSDP2 on token ids through a
SIGKILL, and embeddings of a lazy frame by batch inference, resumed."""

from __future__ import annotations

import importlib
import os
import pathlib
import sys
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("pandas")
pytest.importorskip("dask.dataframe")

import daskdist as dd  # noqa: E402
from tests.conftest import make_cluster, wait_for_workers  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch):
    """The examples import as modules here and in the workers (which inherit
    PYTHONPATH), as they would for a user who runs them."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{EXAMPLES}{os.pathsep}{path}" if path else str(EXAMPLES))


def load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    return importlib.import_module(name)


def test_tabular_dataframe_example_trains_every_row_once_per_epoch():
    from distributed import Client

    tabular = load("tabular_dataframe")
    with make_cluster(2, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="tabular")
        wait_for_workers(client, coord, 2)
        report = tabular.train(coord, partitions=6, rows=300, epochs=2, global_batch_size=64)
        kept = len(tabular.make_frame(6, 300))  # rows whose label is known
        for r in report:
            counts = Counter(r["ids"])
            assert r["rows"] == kept == len(counts) and set(counts.values()) == {1}
            assert np.isfinite(r["loss"])
        coord.close()


def test_batch_inference_example_embeds_every_row_once_and_resumes(tmp_path):
    from distributed import Client

    example = load("batch_inference")
    with make_cluster(2, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="embeddings")
        wait_for_workers(client, coord, 2)
        out = str(tmp_path / "emb")
        r = example.run(coord, out, partitions=6, rows=400, batch_size=128)
        assert r["rows"] == r["distinct"] == 2400 and r["units"] == r["files"] == 6
        emb = example.make_frame(1, 1)  # the ids' frame is the example's own
        assert list(emb.columns)[0] == "id"
        again = example.run(coord, out, partitions=6, rows=400, batch_size=128)
        assert again["rows"] == 2400 and again["resumed_units"] == 6  # done: nothing ran
        coord.close()


def test_images_array_example_survives_a_sigkill_every_image_once():
    from distributed import Client

    images = load("images_array")
    with make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="images")
        wait_for_workers(client, coord, 3)
        r = images.train(coord, client, images=768, chunk=64, epochs=1,
                         global_batch_size=48, kill=True, pause=0.05)
        assert len(r["kills"]) == 1
        seen = np.asarray(r["seen"])
        assert (seen == 1).all(), (int((seen == 0).sum()), int((seen > 1).sum()))
        coord.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_transformer_example_survives_a_sigkill_every_sequence_once():
    from distributed import Client

    gpt = load("fsdp_transformer")
    with make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="fsdp-gpt")
        wait_for_workers(client, coord, 3)
        r = gpt.train(coord, client, sequences=480, length=16, chunk=48, epochs=1,
                      global_batch_size=24, kill=True, pause=0.03)
        assert len(r["kills"]) == 1
        seen = np.asarray(r["seen"])
        assert (seen == 1).all(), (int((seen == 0).sum()), int((seen > 1).sum()))
        assert np.isfinite(r["loss"]) and r["loss"] < np.log(gpt.VOCAB)  # it learned
        coord.close()
