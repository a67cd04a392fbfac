"""The benchmarks' --smoke modes (CPU, tiny sizes): they must keep running, so the GPU runs never rot.

One test function per benchmark script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def test_prepare_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "prepare.json"
    run = subprocess.run([sys.executable, "bench/prepare_throughput.py", "--smoke", "--out", str(out)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["info"]["default_vae_parameters"] == 246_478_803  # the GPU mode's teacher: default config
    sections = {row["section"]: row for row in result["rows"]}
    assert set(sections) == {"teacher", "decode", "read"}
    assert all("error" not in row for row in result["rows"]), result["rows"]
    teacher = [row for row in result["rows"] if row["section"] == "teacher"]
    assert [row["batch"] for row in teacher] == [1, 2] and all(row["clips_per_s"] > 0 for row in teacher)
    assert teacher[0]["teacher_frames"] == 5 and teacher[0]["window_frames"] == 8  # 1 + 4k frames of a 4L window
    assert sections["decode"]["clips_per_s"] > 0 and sections["read"]["clips_per_s"] > 0
    assert "clips per CPU-second" in run.stdout and f"wrote {out}" in run.stdout
