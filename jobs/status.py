"""Status of submitted runs as a table.

    python -m jobs.status [JOBID ... | --all] [--job-dir runs]

Without a job id: the last 20 runs of the job_dir's registry (every run with --all). The job_dir
defaults to $TAEHV_JOB_DIR, else `runs`.
"""

from __future__ import annotations

import argparse
import os
import sys

from jobs._cli import one_line_errors
from taehv_slurm.handle import JobHandle, read_registry

DEFAULT_JOB_DIR = "runs"


def default_job_dir() -> str:
    return os.environ.get("TAEHV_JOB_DIR") or DEFAULT_JOB_DIR


def status_table(handles: list[JobHandle]) -> str:
    """The runs as a left-aligned text table: one row per run, swept values as extra columns, note last."""
    rows = [h.summary() for h in handles]
    columns = list(dict.fromkeys(k for row in rows for k in row if k != "note")) + ["note"]
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.status", description="Status of submitted runs.")
    p.add_argument("job_ids", nargs="*", metavar="JOBID", help="job ids as printed by jobs.submit (default: the latest runs)")
    p.add_argument("--all", action="store_true", help="every run in the registry (default: the last 20)")
    p.add_argument("--job-dir", default=default_job_dir(), help="the cluster config's job_dir (default $TAEHV_JOB_DIR or runs)")
    args = p.parse_args(argv)
    if args.job_ids and args.all:
        p.error("give job ids or --all, not both")
    if args.job_ids:
        handles = [JobHandle.attach(i, args.job_dir) for i in args.job_ids]
    else:
        ids = list(dict.fromkeys(r["job_id"] for r in read_registry(args.job_dir)))
        handles = [JobHandle.attach(i, args.job_dir) for i in (ids if args.all else ids[-20:])]
    if not handles:
        print(f"no runs in {os.path.join(args.job_dir, 'registry.jsonl')} yet")
        return 0
    print(status_table(handles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
