"""Cancel a submitted run (Slurm sends SIGTERM first: the run saves its step before it ends).

    taehv cancel JOB [JOB ...] [--job-dir runs]
"""

from __future__ import annotations

import argparse
import sys

from taehv_slurm.cli.conventions import add_job_dir, one_line_errors
from taehv_slurm.common.messages import command
from taehv_slurm.handle import JobHandle


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=command("cancel"), description="Cancel submitted runs.")
    p.add_argument("job_ids", nargs="+", metavar="JOB", help="job ids or run names")
    add_job_dir(p)
    args = p.parse_args(argv)
    handles = [JobHandle.attach(i, args.job_dir) for i in args.job_ids]  # every id checked before any cancel
    for handle in handles:
        state = handle.state
        if handle.done():
            print(f"job {handle.job_id} already ended ({state}); nothing to cancel")
            continue
        handle.cancel()
        print(f"cancelled job {handle.job_id} (was {state}); it saves at the signal: resubmit with "
              f"--name {handle.name} to resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
