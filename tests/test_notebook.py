"""notebooks/submit_and_monitor.ipynb, executed with nbclient against the real Slurm testbed.

The notebook submits the tiny training and a two-point lr sweep, preempts the training once, and
reads metrics and accounting back. Its plot of the requeued run is written to
docs/submit_and_monitor.png (set TAEHV_SAVE_NOTEBOOK=1 to also write the executed notebook back into
notebooks/, outputs included).
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.usefixtures("slurm_cluster")

NOTEBOOK = REPO / "notebooks" / "submit_and_monitor.ipynb"
PNG = REPO / "docs" / "submit_and_monitor.png"


def outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts += [out["data"].get("text/plain", ""), out["data"].get("text/html", "")]
    return "".join(parts)


def tagged(nb, tag: str):
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}"
    return cells[0]


def test_notebook_runs_on_the_testbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    job_dir = tmp_path / "jobs"
    monkeypatch.setenv("TAEHV_JOB_DIR", str(job_dir))  # the kernel inherits this process's environment
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    began = time.monotonic()
    NotebookClient(nb, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    took = time.monotonic() - began
    nbformat.write(nb, tmp_path / "executed.ipynb")

    summary = json.loads(outputs_text(tagged(nb, "summary")))
    assert summary["state"] == "COMPLETED"
    assert summary["metrics_rows"] > 10 and summary["last_step"] == summary["total_steps"]
    assert summary["requeues"] == 1 and summary["sacct_requeues"] == 1
    assert summary["requeue_reason"] == "preempted"
    assert summary["sacct_states"] == ["REQUEUED", "COMPLETED"]
    assert sorted(summary["sweep_lrs"]) == summary["sweep_lrs"] and len(summary["sweep_lrs"]) == 2
    assert summary["sweep_states"] == ["COMPLETED", "COMPLETED"]

    # Readers see the run, never this machine's paths (the executed notebook may be committed).
    for cell in nb.cells:
        text = outputs_text(cell)
        for path in (str(REPO), str(job_dir), str(tmp_path), "/tmp/"):
            assert path not in text, f"{path} shown in the output of:\n{cell.source[:300]}"
        assert not [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]

    plot = [o for o in tagged(nb, "plot").outputs if "image/png" in o.get("data", {})]
    assert len(plot) == 1, "the plot cell shows one figure"
    png = base64.b64decode(plot[0]["data"]["image/png"])
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    PNG.parent.mkdir(exist_ok=True)
    PNG.write_bytes(png)
    sweep_plot = [o for o in tagged(nb, "sweep-plot").outputs if "image/png" in o.get("data", {})]
    assert len(sweep_plot) == 1
    if os.environ.get("TAEHV_SAVE_NOTEBOOK") == "1":
        nbformat.write(nb, NOTEBOOK)
    print(f"\nnotebook executed in {took:.0f} s")
