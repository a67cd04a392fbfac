"""Show or follow one rank's log of a submitted run.

    python -m jobs.logs JOBID [--rank R] [--lines N] [--follow] [--job-dir runs]
"""

from __future__ import annotations

import argparse
import sys
import time

from jobs._cli import one_line_errors
from taehv_slurm.handle import FINAL_STATES, JobHandle


def follow(handle: JobHandle, rank: int = 0, poll_s: float = 1.0, out=sys.stdout) -> str:
    """Print the rank's log as it grows until the job ends; returns the final state."""
    position = 0
    while True:
        state = handle.state
        path = handle.log_path(rank)
        if path.exists():
            with path.open("rb") as f:
                f.seek(position)
                chunk = f.read()
                position = f.tell()
            if chunk:
                out.write(chunk.decode(errors="replace"))
                out.flush()
        if state.split()[0] in FINAL_STATES:
            return state
        time.sleep(poll_s)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.logs", description="Show or follow a rank's log.")
    p.add_argument("job_id")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--lines", "-n", type=int, default=40)
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--job-dir", default="runs", help="the cluster config's job_dir (default runs)")
    args = p.parse_args(argv)
    handle = JobHandle.attach(args.job_id, args.job_dir)
    world = int(handle.record.get("world_size", 1))
    if not 0 <= args.rank < world:
        print(f"error: job {args.job_id} has ranks 0..{world - 1}; --rank {args.rank} does not exist", file=sys.stderr)
        return 2
    if args.follow:
        print(f"job {handle.job_id} ended: {follow(handle, args.rank)}")
    else:
        text = handle.tail(args.lines, args.rank)
        print(text if text else f"(no log yet at {handle.log_path(args.rank)}; job state {handle.state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
