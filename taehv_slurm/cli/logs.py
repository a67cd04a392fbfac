"""Show or follow one rank's log of a submitted run.

    taehv logs JOB [--rank R] [--lines N] [--follow] [--job-dir runs]

A requeued job appends each run to the same log, so --follow keeps going across requeues until the
job ends.
"""

from __future__ import annotations

import argparse
import sys

from taehv_slurm.cli.conventions import add_job_dir, one_line_errors
from taehv_slurm.common.messages import command
from taehv_slurm.handle import JobHandle


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=command("logs"), description="Show or follow a rank's log.")
    p.add_argument("job_id", metavar="JOB", help="a job id, or a run name (its newest job)")
    p.add_argument("--rank", type=int, default=0, help="which rank's log (default 0)")
    p.add_argument("--lines", "-n", type=int, default=40, help="lines to show (default 40)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="show the last lines, then stream until the job ends")
    add_job_dir(p)
    args = p.parse_args(argv)
    handle = JobHandle.attach(args.job_id, args.job_dir)
    world = int(handle.record.get("world_size", 1))
    if not 0 <= args.rank < world:
        print(f"error: job {args.job_id} has ranks 0..{world - 1}; --rank {args.rank} does not exist",
              file=sys.stderr)
        return 2
    text, size = handle.log_tail(args.lines, args.rank)
    if text:
        print(text, flush=True)
    elif not args.follow:
        print(f"(no log yet for rank {args.rank}; job {handle.job_id} is {handle.state})")
    if args.follow:  # on from exactly where the lines above ended: nothing twice, nothing skipped
        print(f"job {handle.job_id} ended: {handle.follow(args.rank, position=size)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
