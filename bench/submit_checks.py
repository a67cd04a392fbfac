"""What the submit-time checks cost on the login node: `jobs.submit --dry-run` as the user runs it, on a
folder of 10 000 video files, with the data check and without it (`--skip-data-checks`).

    python bench/submit_checks.py [--files 10000] [--repeats 3] [--out FILE]

The folder holds hard links to one short video (a real directory of 10 000 entries, one file's bytes).
End to end: the whole CLI (its imports, configs, plan, checks and the printed table), best of
`--repeats`. Beside it, labelled as isolated: listing the folder alone
(taehv_slurm.trainer.data_checks.list_videos), and the data check's own process
(`python -m taehv_slurm.trainer.data_checks`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import run_info, write_results  # noqa: E402
from bench.videos import write_video  # noqa: E402
from taehv_slurm.common.config import load_train  # noqa: E402
from taehv_slurm.trainer.data_checks import list_videos  # noqa: E402


def timed(args: list[str], stdin: str | None = None) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    return time.perf_counter() - start, done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="taehv-bench-checks-") as tmp:
        folder = Path(tmp) / "videos"
        folder.mkdir()
        first = folder / "v00000.mp4"
        write_video(first, 24, 128, 128)
        for i in range(1, args.files):
            os.link(first, folder / f"v{i:05d}.mp4")
        submit = [sys.executable, "-m", "jobs.submit", "--local", "--train", "configs/train/tiny.yaml",
                  "--set", f"job_dir={tmp}/runs", "--set", "data.source=video",
                  "--set", f"data.path={folder}", "--set", "teacher.kind=none",
                  "--name", "bench", "--dry-run"]
        results: dict[str, list[float]] = {"submit_dry_run_with_data_check_s": [],
                                           "submit_dry_run_skip_data_checks_s": [], "listing_s": [],
                                           "data_check_process_s": []}
        request = json.dumps({"train": load_train("configs/train/tiny.yaml", **{
            "data.source": "video", "data.path": str(folder)}).to_dict(), "sample": 8, "budget_s": 10})
        detail = ""
        for _ in range(args.repeats):
            seconds, done = timed(submit)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            detail = next(line for line in done.stdout.splitlines() if line.startswith("data "))
            results["submit_dry_run_with_data_check_s"].append(seconds)
            seconds, done = timed([*submit, "--skip-data-checks"])
            assert done.returncode == 0, done.stderr[-2000:]
            results["submit_dry_run_skip_data_checks_s"].append(seconds)
            start = time.perf_counter()
            files, complete = list_videos(folder, time.monotonic() + 60)
            results["listing_s"].append(time.perf_counter() - start)
            assert complete and len(files) == args.files
            seconds, done = timed([sys.executable, "-m", "taehv_slurm.trainer.data_checks"], request)
            results["data_check_process_s"].append(seconds)
    best = {key: round(min(values), 3) for key, values in results.items()}
    payload = {**run_info(False, files=args.files, repeats=args.repeats), "best": best, "all": results,
               "data_row": detail.strip()}
    for key, value in best.items():
        print(f"{key:36s} {value:.3f}")
    print(detail)
    write_results(args.out, "submit_checks", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
