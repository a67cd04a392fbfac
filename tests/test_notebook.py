"""notebooks/submit_and_monitor.ipynb, run by papermill against the real Slurm testbed as a user runs it on a
cluster: its parameters cell gets a cluster config, a train config and a folder of real video files
(written here), never an edit of its code. The kernel runs in a folder of the test's own, so every injected
value is a relative path and the executed notebook can be committed as it is (scripts/refresh_notebook.sh
runs this test and copies it). The executed notebook and its figures go to $TAEHV_NOTEBOOK_OUT (default: the
test's tmp folder).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench.videos import write_video
from taehv_slurm.common.runfolder import RunFolder
from tests.helpers import REPO, read_strictly

pytestmark = pytest.mark.usefixtures("slurm_cluster")

NOTEBOOK = REPO / "notebooks" / "submit_and_monitor.ipynb"
PARAMETERS = {"CLUSTER": "cluster.yaml", "TRAIN": "train.yaml", "DATA": "videos", "NAME": "tiny-demo",
              "STEPS": 40, "STOP_AT": 16}
FIGURES = ("plot", "plot-resumed", "reconstruction")


def moving_square(offset: int):
    """Frames of a square moving over a flat background: something a tiny autoencoder learns in 40 steps."""
    def frame(k: int, width: int, height: int) -> np.ndarray:
        image = np.full((height, width, 3), (40 + 5 * offset, 90, 160), np.uint8)
        x, y = (3 * k + 7 * offset) % (width - 16), (2 * k + 5 * offset) % (height - 16)
        image[y:y + 16, x:x + 16] = (240, 200, 40)
        return image
    return frame


def user_files(work: Path) -> None:
    """What a user brings: a cluster config (the testbed's, one node of 2 "GPUs"), a train config (the tiny
    model, logging often) and a folder of videos."""
    cluster = yaml.safe_load((REPO / "configs/cluster/testbed.yaml").read_text())
    (work / "cluster.yaml").write_text(yaml.safe_dump({**cluster, "gpus_per_node": 2, "time_min": 15}))
    train = yaml.safe_load((REPO / "configs/train/tiny.yaml").read_text())
    train["intervals"].update(log_every=2, val_every=8)
    train["optim"]["warmup_steps"] = 8
    (work / "train.yaml").write_text(yaml.safe_dump(train))
    for i in range(24):
        write_video(work / "videos" / f"clip{i:02d}.mp4", 24, 64, 64, frame_fn=moving_square(i))


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


def test_notebook_runs_on_the_testbed(tmp_path: Path) -> None:
    import nbformat
    import papermill

    work = tmp_path / "work"
    (work / "videos").mkdir(parents=True)
    user_files(work)
    out = Path(os.environ.get("TAEHV_NOTEBOOK_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    nb = papermill.execute_notebook(NOTEBOOK, out / NOTEBOOK.name, parameters=PARAMETERS, cwd=str(work),
                                    kernel_name="python3", progress_bar=False, execution_timeout=600)
    took = time.monotonic() - began
    # papermill records where it read and wrote the notebook: the repo's name for both, not this machine's
    nb.metadata.papermill.update(input_path=f"notebooks/{NOTEBOOK.name}", output_path=NOTEBOOK.name)
    nbformat.write(nb, out / NOTEBOOK.name)

    record = json.loads(outputs_text(tagged(nb, "summary")))
    assert record["run"] == "tiny-demo" and record["state"] == "COMPLETED" and record["steps"] == 40
    cancelled = record["cancelled_job"]
    assert cancelled["state"].startswith("CANCELLED") and cancelled["saved_step"] >= 16
    assert record["resumed_from"] == cancelled["saved_step"]  # nothing lost, nothing trained twice
    rows = read_strictly(RunFolder(work / "runs/tiny-demo").metrics())
    logged = [row["step"] for row in rows if "loss" in row]
    assert logged == [1, *range(2, 41, 2)] and record["logged_lines"] == len(logged)  # each step once
    assert [a["state"].split()[0] for a in record["attempts"]] == ["CANCELLED", "COMPLETED"]
    assert all(a["max_rss_gb"] > 0.05 for a in record["attempts"]), record["attempts"]  # sacct's, per job
    exported = work / "runs/tiny-demo/tiny-demo.safetensors"  # in the run folder, not the user's
    assert sorted(p.name for p in work.iterdir()) == ["cluster.yaml", "runs", "train.yaml", "videos"]
    assert record["export"]["step"] == 40
    assert record["export"]["sha256"] == hashlib.sha256(exported.read_bytes()).hexdigest()

    # Readers see the run, never this machine's paths (the executed notebook is committed).
    injected = tagged(nb, "injected-parameters").source
    for cell in nb.cells:
        text = outputs_text(cell)
        for path in (str(REPO), str(tmp_path), "/tmp/"):
            assert path not in text, f"{path} shown in the output of:\n{cell.source[:300]}"
            assert path not in injected
        assert not [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    for tag in FIGURES:
        (figure,) = [o for o in tagged(nb, tag).outputs if "image/png" in o.get("data", {})]
        png = base64.b64decode(figure["data"]["image/png"])
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, tag
        (out / f"notebook-{tag}.png").write_bytes(png)
    print(f"\nnotebook executed in {took:.0f} s")
