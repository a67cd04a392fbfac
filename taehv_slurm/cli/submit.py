"""Submit TAEHV training (or the smoke check) to Slurm, or run it here with --local.

    taehv submit --nodes 8 --dry-run          # the sbatch script and the plan, nothing submitted
    taehv submit --nodes 8                    # submit; prints the job id and how to follow it
    taehv submit --local --train configs/train/tiny.yaml   # train on this machine, no cluster
    taehv submit --task smoke --nodes 2       # every rank rendezvous + all-reduce, then report
    taehv submit --sweep optim.lr=1e-4,2e-4   # a job array, one run per value

Imports no torch: the ranks import the trainer.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from taehv_slurm import slurm, snapshot
from taehv_slurm.backends import backend_named
from taehv_slurm.cli import watch
from taehv_slurm.cli.conventions import (
    DEFAULT_CLUSTER,
    DEFAULT_TRAIN,
    EXIT_DONE,
    EXIT_FAILED,
    add_cluster_flags,
    flag_origins,
    load_cluster_from_args,
    one_line_errors,
    stopped_exit_code,
    terminate_as_interrupt,
)
from taehv_slurm.common.config import ClusterConfig, ConfigError, TrainConfig, load_train, split_overrides
from taehv_slurm.common.messages import command
from taehv_slurm.common.plan import ScalePlan, plan_for_cluster
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.common.security import describe_secret_env
from taehv_slurm.common.typed_yaml import parse_set_args
from taehv_slurm.executor import sbatch_preview
from taehv_slurm.handle import JobHandle
from taehv_slurm.registry import Registry, UnknownJobError
from taehv_slurm.runtime.smoke import SmokeTask
from taehv_slurm.slurm import is_success
from taehv_slurm.slurm_checks import NOT_CHECKED
from taehv_slurm.submission import check_target, submit
from taehv_slurm.submit_checks import Row, machine_rows, require_passing, table
from taehv_slurm.sweep import point_name, sweep_grid, sweep_trains
from taehv_slurm.training import RunCompleteError, reachable_rows, submit_training, training_checks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=command("submit"), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--train", default=DEFAULT_TRAIN, help=f"training YAML (default {DEFAULT_TRAIN})")
    p.add_argument("--task", choices=["train", "smoke"], default="train", help="what to run (default train)")
    add_cluster_flags(p, local=True, set_help="override any cluster or train key, e.g. --set optim.lr=2e-4 "
                                              "--set env.NCCL_DEBUG=INFO")
    p.add_argument("--spare-nodes", type=int,
                   help="nodes asked beyond --nodes: each can take a failed node's place inside the job "
                        "(default from the cluster config, 0)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="submit one run per value (a job array); several --sweep make a grid")
    p.add_argument("--max-parallel", type=int, metavar="N",
                   help="a sweep's runs at once on Slurm "
                        "(default: array_parallelism in the cluster config, 4)")
    p.add_argument("--name", help="run name; submitting the same name again resumes its checkpoints")
    p.add_argument("--dry-run", action="store_true",
                   help="print the job, the plan and the sbatch script; submit nothing")
    p.add_argument("--local", action="store_true",
                   help="run here with the local backend (no Slurm) and follow it")
    p.add_argument("--follow", action="store_true", help="stream rank 0's log until the job ends")
    p.add_argument("--skip-data-checks", action="store_true",
                   help="do not read the data before submitting (a login node that cannot see it; the job "
                        "still checks at start-up); the same as --set check_data_on_submit=false")
    p.add_argument("--force", action="store_true",
                   help="the run name has a live job: cancel it (it saves at the signal), wait, then submit")
    p.add_argument("--after", metavar="JOB",
                   help="start once job JOB (a job id, or a run name of the job_dir, e.g. a `taehv prepare` "
                        "run) has completed, and never if it fails; its data is not read before submitting")
    p.add_argument("--no-snapshot", action="store_true",
                   help="a Slurm job imports the checkout as it is when each attempt starts, not the copy of "
                        "its tracked files made now; the same as --set code_snapshot=false")
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster_over, train_over = split_overrides(parse_set_args(args.set))
    if args.no_snapshot:
        cluster_over["code_snapshot"] = False
    cluster = load_cluster_from_args(args, cluster_over)
    if args.after:
        cluster.sbatch_args = {**cluster.sbatch_args, **dependency_on(args.after, cluster.job_dir)}
        args.skip_data_checks = True  # what the job trains on may be what JOB makes
    train = load_train(args.train, origins=flag_origins(args), **train_over)
    if args.sweep and args.task != "train":
        raise ConfigError("--sweep applies to --task train")
    trains, sweep = sweep_trains(train, sweep_grid(args.sweep)) if args.sweep else ([train], [])
    # checks every point
    plans = [plan_for_cluster(cluster, t) for t in trains] if args.task == "train" else []
    run_name = args.name or (f"{train.name if args.task == 'train' else 'smoke'}-"
                             f"{time.strftime('%Y%m%d-%H%M%S')}")
    if args.task == "train":
        checks = training_checks(cluster, trains, plans, run_name, sweep, data=False if args.skip_data_checks
                                 else None, preview=args.dry_run)
    else:
        check_target(cluster, [run_name])
        checks = machine_rows(cluster) + (reachable_rows(cluster, preview=True) if args.dry_run else [])
    if args.dry_run:
        preflight = (f"{command('preflight')} --cluster {args.cluster or DEFAULT_CLUSTER} "
                     f"--nodes {cluster.nodes}")
        return dry_run(cluster, trains, sweep, plans, run_name, checks, preflight)
    require_passing(checks)
    for row in checks:  # what the user should know before the job waits in the queue
        if row.result == "WARN" or row.check == "changed":
            print(f"{row.check}: {row.detail}")
    if args.task == "smoke":
        task = SmokeTask(backend=cluster.dist_backend, rendezvous_timeout_s=cluster.rendezvous_timeout_s)
        handles = [submit(task, cluster, run_name, requeueable=False, record={"task_kind": "smoke"},
                          force=args.force)]
    else:
        try:
            handles = submit_training(cluster, trains, run_name, sweep, force=args.force, plans=plans,
                                      checks=checks)
        except RunCompleteError as done:
            print(done)
            return 0
    print_submitted(cluster, handles)
    backend = backend_named(cluster.backend)
    if not (args.local or args.follow or backend.runs_here):
        return 0
    stop = backend.cancel_on_interrupt
    with terminate_as_interrupt():
        if len(handles) > 1:
            states, stopped = watch.follow_all(handles, stop_on_interrupt=stop)
            return watch.report_all(handles, states, stopped)
        state, stopped = watch.follow_to_the_end(handles[0], stop_on_interrupt=stop)
        watch.report_end(handles[0], state, stopped)
    if args.task == "smoke" and is_success(state):
        for facts in sorted(handles[0].results(), key=lambda f: f["rank"]):
            print(facts)
    if is_success(state):
        return EXIT_DONE
    return stopped_exit_code(stopped) if stopped is not None else EXIT_FAILED


def dry_run(cluster: ClusterConfig, trains: list[TrainConfig], sweep: list[dict], plans: list[ScalePlan],
            run_name: str, checks: list[Row], preflight: str) -> int:
    """Print the job, the plan of every run, the sbatch script and the submit-time checks; submit nothing.
    Exit 2 when a check FAILs (the submit would refuse). Where Slurm cannot be reached, the rows that need it
    say `not checked here (no Slurm)` and the line after the table names `preflight`, the command that
    checks them on a login node."""
    run_dir = Path(cluster.job_dir) / run_name
    where = f"partition {cluster.partition}" if cluster.partition else "default partition"
    spares = f" (+ {cluster.spare_nodes} spare node(s))" if cluster.spare_nodes else ""
    print(f"job: {cluster.backend} backend, {where}, {cluster.nodes} node(s){spares} × "
          f"{cluster.tasks_per_node} tasks = "
          f"world size {cluster.world_size}; gres {cluster.gres_request or 'none'}, {cluster.cpus_per_task} "
          f"CPUs/task, time {cluster.time_min} min, device {cluster.task_device()}\nrun folder: {run_dir}")
    if secret_line := describe_secret_env(cluster):  # names only: values are masked, never printed
        print(secret_line)
    for point, plan in zip(sweep or [{}], plans):
        print(f"\nplan{' for ' + str(point) if point else ''}:\n{plan.table()}")
    if sweep:
        print(f"\n{len(sweep)} runs, one job array: "
              + ", ".join(str(run_dir / point_name(p)) for p in sweep))
    if backend_named(cluster.backend).writes_sbatch_script:
        env = {**(plans[0].nccl_env if plans else {}), **snapshot.job_env(cluster, copy=False)}
        folder = RunFolder(run_dir).submitit  # a sweep's: the array's one folder beside its runs
        script = sbatch_preview(cluster, folder, env, run_dir, array_size=len(trains))
        print(f"\nsbatch script ({folder}/):\n{script}")
    if checks:
        print(f"\nchecks:\n{table(checks)}")
    if any(r.detail.startswith(NOT_CHECKED) for r in checks):
        print(f"on a login node, `{preflight}` checks the rows not checked here")
    failed = [r.check for r in checks if r.result == "FAIL"]
    if failed:
        print(f"a submit would be refused: check{'s' if len(set(failed)) > 1 else ''} "
              f"{', '.join(dict.fromkeys(failed))} failed (nothing was submitted)")
        return 2
    return 0


def dependency_on(job: str, job_dir: str) -> dict[str, str]:
    """sbatch's flags that start a job once `job` (a job id, or a run of job_dir: its newest job) completed;
    ConfigError in one line when Slurm knows no such job."""
    try:
        job_id = Registry.load(job_dir).find(job)["job_id"] if not re.fullmatch(r"\d+(_\d+)?", job) else job
    except UnknownJobError as err:
        raise ConfigError(f"--after {job}: {err}") from None
    state = slurm.job_state(job_id)
    if state is None:
        raise ConfigError(f"--after {job}: Slurm knows no job {job_id} (neither squeue nor sacct lists it): "
                          "check the id (`squeue --me`, `taehv status`)")
    if slurm.is_final(state) and not slurm.is_success(state):
        raise ConfigError(f"--after {job}: job {job_id} ended {state}; this job would never start")
    return {"dependency": f"afterok:{job_id}", "kill-on-invalid-dep": "yes"}


def print_submitted(cluster: ClusterConfig, handles: list[JobHandle]) -> None:
    """What was submitted, where its logs are, and how to follow it."""
    for handle in handles:
        point = f" {point_name(handle.sweep)}" if handle.sweep else ""
        print(f"submitted job {handle.job_id}{point}: {cluster.nodes} node(s) × "
              f"{cluster.tasks_per_node} tasks, "
              f"run folder {handle.run_dir}")
    if len(handles) > 1:
        ids = " ".join(h.job_id for h in handles)
        array = " (one job array)" if backend_named(cluster.backend).writes_sbatch_script else ""
        print(f"sweep of {len(handles)} runs{array}: {command('status')} {ids} --job-dir {cluster.job_dir}")
    first = handles[0]
    more = f" … {first.log_path(cluster.world_size - 1).name}" if cluster.world_size > 1 else ""
    print(f"logs: {first.log_path(0)} (rank 0){more}")
    print(f"follow: {command('logs')} {first.job_id} --follow --job-dir {cluster.job_dir}")
    print(f"status: {command('status')} {first.job_id} --job-dir {cluster.job_dir}")


if __name__ == "__main__":
    sys.exit(main())
