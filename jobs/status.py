"""Status of submitted runs as a table.

    python -m jobs.status [JOBID | --all] [--job-dir runs]
"""

from __future__ import annotations

import argparse
import sys
import time

from jobs._cli import one_line_errors
from taehv_slurm.handle import JobHandle, read_registry


def status_row(handle: JobHandle) -> dict:
    requeues = handle.requeues
    return {
        "job_id": handle.job_id,
        "run": handle.run_dir.name if handle.run_dir.parent.name == "runs" else str(handle.run_dir),
        "state": handle.state,
        "nodes": handle.record.get("nodes"),
        "ranks": handle.record.get("world_size"),
        "step": handle.last_step(),
        "requeues": len(requeues),
        "submitted": time.strftime("%Y-%m-%d %H:%M", time.localtime(handle.record.get("submitted_at", 0))),
        "note": handle.stop_reason or "",
    }


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    p = argparse.ArgumentParser(prog="python -m jobs.status", description="Status of submitted runs.")
    p.add_argument("job_id", nargs="?")
    p.add_argument("--all", action="store_true", help="every run in the registry (default: the last 20)")
    p.add_argument("--job-dir", default="runs")
    args = p.parse_args(argv)
    if args.job_id:
        handles = [JobHandle.attach(args.job_id, args.job_dir)]
    else:
        records = read_registry(args.job_dir)
        ids = list(dict.fromkeys(r["job_id"] for r in records))
        handles = [JobHandle.attach(i, args.job_dir) for i in (ids if args.all else ids[-20:])]
    if not handles:
        print(f"no runs in {args.job_dir}/registry.jsonl yet")
        return 0
    frame = pd.DataFrame([status_row(h) for h in handles])
    print(frame.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
