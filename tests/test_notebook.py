"""The example notebook runs top to bottom (as a JupyterLab user would run it)."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs
            if o.output_type == "execute_result" and "text/html" in o.get("data", {})]
    for name in ("daskdist Coordinator", "RemoteValue", "daskdist DistributedDataset",
                 "daskdist CollectiveGroup"):
        assert any(name in h for h in html), name  # each HTML repr rendered
    (ds_html,) = [h for h in html if "daskdist DistributedDataset" in h]
    assert "4,000 of 4,000 rows acknowledged" in ds_html
    # the tqdm.auto bars ran (a widget, or text on stderr where ipywidgets is missing)
    bars = [o for o in outputs if o.output_type == "display_data"
            or (o.output_type == "stream" and "closures" in o.get("text", ""))]
    assert bars
