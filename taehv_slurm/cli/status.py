"""Status of submitted runs, or Slurm's accounting of them, as a table, CSV or JSON.

    taehv status [JOB ... | --all] [--job-dir runs] [--format table|csv|json]
    taehv status JOB --accounting [--format csv]     # sacct: one row per run attempt
    taehv status JOB --goodput [--format json]       # goodput: one row per attempt, ETTR

Without a job id: the last 20 runs of the job_dir's registry (every run with --all). The job_dir
defaults to $TAEHV_JOB_DIR, else `runs`. --accounting shows each attempt (the first run and every
requeue): state, exit code, elapsed, nodes, GPUs, max RSS. --goodput shows each attempt's allocated
node-seconds, time to first step, steps kept, work lost, time in saves and ETTR (productive /
allocated). Where the Slurm controller does not answer, the states are Slurm's accounting, with a note
on stderr that says so; where Slurm's accounting does not answer, a note says what that leaves out
(--accounting fails, exit 1).
"""

from __future__ import annotations

import argparse
import os
import sys

from taehv_slurm import jobstates
from taehv_slurm.cli.conventions import add_job_dir, one_line_errors
from taehv_slurm.common.messages import command
from taehv_slurm.common.runfolder import REGISTRY
from taehv_slurm.handle import JobHandle
from taehv_slurm.registry import Registry
from taehv_slurm.reports import render
from taehv_slurm.runs import accounting_frame, asked_once, status_frame, status_table


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=command("status"), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("job_ids", nargs="*", metavar="JOB",
                   help="job ids as jobs.submit prints them, or run names (default: the latest runs)")
    p.add_argument("--all", action="store_true", help="every run in the registry (default: the last 20)")
    p.add_argument("--accounting", action="store_true",
                   help="Slurm's accounting (sacct) of the runs, one row per attempt")
    p.add_argument("--goodput", action="store_true",
                   help="each attempt's goodput: allocated, time to first step (and its start-up), kept, "
                        "lost, saves, ETTR")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table",
                   help="output format (default table)")
    add_job_dir(p)
    args = p.parse_args(argv)
    if args.job_ids and args.all:
        p.error("give job ids or --all, not both")
    ids = args.job_ids or Registry.load(args.job_dir).job_ids()
    handles = [JobHandle.attach(i, args.job_dir) for i in (ids if args.job_ids or args.all else ids[-20:])]
    if not handles:
        print(f"no runs in {os.path.join(args.job_dir, REGISTRY)} yet")
        return 0
    if not (args.goodput or args.accounting) and args.format == "table":
        print(status_table(handles))  # text only: no pandas
        return _note_silence()
    if args.goodput:
        import pandas as pd

        with asked_once(handles):
            frame = pd.concat([h.goodput().assign(job_id=h.job_id, run=h.name) for h in handles],
                              ignore_index=True)
    else:
        frame = accounting_frame(handles) if args.accounting else status_frame(handles)
    if args.accounting and (failed := jobstates.accounting_silence()):
        print(f"error: {failed}", file=sys.stderr)  # an empty table would say there is no accounting
        return 1
    if args.accounting and frame.empty and args.format == "table":
        print("no accounting for these runs: local runs have none, and on Slurm it needs slurmdbd "
              "(sacct: 'Slurm accounting storage is disabled' means the cluster keeps none)")
        return 0
    print(render(frame, args.format))
    return _note_silence()


def _note_silence() -> int:
    """Notes on stderr where squeue got no answer (the states shown are accounting's) or sacct got none."""
    jobstates.SilenceWatch().tell()
    return 0


if __name__ == "__main__":
    sys.exit(main())
