"""notebooks/submit_and_monitor.ipynb, executed with nbclient against the real Slurm testbed.

The notebook submits the tiny training and a two-point lr sweep, preempts the training once, reads
metrics and accounting back, re-attaches to the run by name, and cancels a third run (which saves). The
executed notebook and its plot are written outside the tracked
tree, to $TAEHV_NOTEBOOK_OUT (default: the test's tmp folder); scripts/refresh_notebook.sh runs this test
and copies both into notebooks/ and docs/, so the committed outputs and the PNG come from one run.
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
    out = Path(os.environ.get("TAEHV_NOTEBOOK_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / NOTEBOOK.name)

    summary = json.loads(outputs_text(tagged(nb, "summary")))
    assert summary["state"] == "COMPLETED"
    assert summary["metrics_rows"] > 10 and summary["last_step"] == summary["total_steps"]
    assert summary["requeues"] == 1 and summary["sacct_requeues"] == 1
    assert summary["requeue_reason"] == "preempted"
    assert summary["sacct_states"] == ["REQUEUED", "COMPLETED"]
    assert sorted(summary["sweep_lrs"]) == summary["sweep_lrs"] and len(summary["sweep_lrs"]) == 2
    assert summary["sweep_states"] == ["COMPLETED", "COMPLETED"]
    assert summary["attempts"] == [[0, "REQUEUED"], [1, "COMPLETED"]]
    assert summary["cancelled_state"].startswith("CANCELLED") and summary["cancel_saved_step"] >= 3

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
    (out / "submit_and_monitor.png").write_bytes(png)
    sweep_plot = [o for o in tagged(nb, "sweep-plot").outputs if "image/png" in o.get("data", {})]
    assert len(sweep_plot) == 1
    print(f"\nnotebook executed in {took:.0f} s")
