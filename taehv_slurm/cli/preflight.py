"""Check a cluster before a long run: configs, plan, dependencies, data, checkpoint space, Slurm resources.

    taehv preflight --nodes 8                    # checks from here, including `sinfo`
    taehv preflight --nodes 8 --job              # + a short job on 8 nodes: GPUs, rendezvous, bandwidth
    taehv preflight --nodes 2 --cluster configs/cluster/testbed.yaml --train configs/train/tiny.yaml --job

Prints one row per check (PASS, FAIL, WARN or SKIP) and exits 1 when a row FAILs. Each FAIL names what
to change. Where Slurm cannot be reached (a laptop), the rows that need it say `not checked here (no
Slurm)` and the rest are checked. The job (--job) runs the smoke task on every rank: GPUs each node's
ranks can see, the rendezvous of all ranks, all-reduce bus bandwidth by message size, and each node's host
and driver.
"""

from __future__ import annotations

import argparse
import sys

from taehv_slurm.cli.conventions import (
    DEFAULT_TRAIN,
    add_cluster_flags,
    cluster_flag_overrides,
    flag_origins,
    one_line_errors,
)
from taehv_slurm.common.config import ConfigError, split_overrides
from taehv_slurm.common.messages import command
from taehv_slurm.common.typed_yaml import parse_set_args
from taehv_slurm.preflight_checks import Preflight, PreflightOptions
from taehv_slurm.submit_checks import Row, table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=command("preflight"), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--train", default=DEFAULT_TRAIN, help=f"training YAML (default {DEFAULT_TRAIN})")
    add_cluster_flags(p, local=False, nodes_required=True, time_min=False)
    p.add_argument("--job", action="store_true",
                   help="also run a short job on the nodes (smoke task + bandwidth)")
    p.add_argument("--bandwidth-mib", default="1,16,128", metavar="SIZES",
                   help="all-reduce message sizes in MiB for the job (default 1,16,128)")
    p.add_argument("--min-bus-gbps", type=float, default=0.0,
                   help="FAIL when the slowest rank's bus bandwidth at the largest size is below this (GB/s)")
    p.add_argument("--job-timeout-s", type=float, default=900.0,
                   help="how long to wait for the job (queue + run)")
    p.add_argument("--sample-clips", type=int, default=8, help="video files to open and decode a window of")
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 1:
        raise ConfigError(f"--nodes must be ≥ 1, got {args.nodes}")
    options = PreflightOptions(job=args.job,
                               bandwidth_mib=tuple(int(s) for s in args.bandwidth_mib.split(",")
                                                   if s.strip()),
                               min_bus_gbps=args.min_bus_gbps, job_timeout_s=args.job_timeout_s,
                               sample_clips=args.sample_clips,
                               origins=flag_origins(args))
    try:
        cluster_over, train_over = split_overrides(parse_set_args(args.set))
    except ConfigError as err:  # a bad --set is this table's first row, like a bad config file
        print(table([Row("cluster config", "FAIL", str(err)),
                     Row("train config", "SKIP", "needs valid --set overrides")]))
        return 1
    preflight = Preflight(args.cluster, args.train, cluster_flag_overrides(args, cluster_over), train_over,
                          options)
    rows = preflight.run()
    print(table(rows), flush=True)
    if preflight.no_slurm:
        print("the rows not checked here need Slurm: run the same command on a login node", flush=True)
    failed = [r.check for r in rows if r.result == "FAIL"]
    if failed:
        print(f"preflight FAILED: {', '.join(failed)}", flush=True)
        return 1
    skipped = sum(r.result == "SKIP" for r in rows)
    print(f"preflight passed: {len(rows) - skipped} checks ({skipped} skipped)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
