"""Cancel a submitted run (Slurm sends SIGTERM first: the job saves before it ends).

    python -m jobs.cancel JOBID [--job-dir runs]
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import one_line_errors
from taehv_slurm.handle import JobHandle


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.cancel", description="Cancel a submitted run.")
    p.add_argument("job_id")
    p.add_argument("--job-dir", default="runs")
    args = p.parse_args(argv)
    handle = JobHandle.attach(args.job_id, args.job_dir)
    if handle.done():
        print(f"job {handle.job_id} already ended ({handle.state}); nothing to cancel")
        return 0
    handle.cancel()
    print(f"cancelled job {handle.job_id} (it saves at the signal; resubmit with --name {handle.run_dir.name} to resume)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
