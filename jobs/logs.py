"""Show or follow one rank's log of a submitted run.

    python -m jobs.logs JOBID [--rank R] [--lines N] [--follow] [--job-dir runs]

A requeued job appends each run to the same log, so --follow keeps going across requeues until the
job ends.
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import one_line_errors
from jobs.status import default_job_dir
from taehv_slurm.handle import JobHandle


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.logs", description="Show or follow a rank's log.")
    p.add_argument("job_id", metavar="JOBID")
    p.add_argument("--rank", type=int, default=0, help="which rank's log (default 0)")
    p.add_argument("--lines", "-n", type=int, default=40, help="lines to show (default 40)")
    p.add_argument("--follow", "-f", action="store_true", help="show the last lines, then stream until the job ends")
    p.add_argument("--job-dir", default=default_job_dir(), help="the cluster config's job_dir (default $TAEHV_JOB_DIR or runs)")
    args = p.parse_args(argv)
    handle = JobHandle.attach(args.job_id, args.job_dir)
    world = int(handle.record.get("world_size", 1))
    if not 0 <= args.rank < world:
        print(f"error: job {args.job_id} has ranks 0..{world - 1}; --rank {args.rank} does not exist", file=sys.stderr)
        return 2
    text, size = last_lines(handle, args.rank, args.lines)
    if text:
        print(text, flush=True)
    elif not args.follow:
        print(f"(no log yet for rank {args.rank}; job {handle.job_id} is {handle.state})")
    if args.follow:  # on from exactly where the lines above ended: nothing twice, nothing skipped
        print(f"job {handle.job_id} ended: {handle.follow(args.rank, position=size)}")
    return 0


def last_lines(handle: JobHandle, rank: int, n: int) -> tuple[str, int]:
    """The last `n` lines of the rank's log and the byte size they end at (0 when there is no log yet)."""
    path = handle.log_path(rank)
    if not path.exists():
        return "", 0
    with path.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - 256 * 1024))
        data = f.read(size - f.tell())
    return "\n".join(data.decode(errors="replace").splitlines()[-n:]), size


if __name__ == "__main__":
    sys.exit(main())
