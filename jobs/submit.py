"""Submit TAEHV training (or the smoke check) to Slurm, or run it here with --local.

    python -m jobs.submit --nodes 8 --dry-run          # the sbatch script and the plan, nothing submitted
    python -m jobs.submit --nodes 8                    # submit; prints the job id and how to follow it
    python -m jobs.submit --local --train configs/train/tiny.yaml   # train on this machine, no cluster
    python -m jobs.submit --task smoke --nodes 2       # every rank rendezvous + all-reduce, then report
    python -m jobs.submit --sweep optim.lr=1e-4,2e-4   # a job array, one run per value

Imports no torch unless it submits the training task.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from jobs._cli import (
    DEFAULT_CLUSTER,
    DEFAULT_TRAIN,
    LOCAL_CLUSTER,
    load_cluster_from_args,
    one_line_errors,
    resolve,
)
from taehv_slurm.config import ConfigError, load_train, parse_set_args, split_overrides
from taehv_slurm.executor import sbatch_preview, task_device
from taehv_slurm.handle import LogFollower
from taehv_slurm.plan import plan_for
from taehv_slurm.slurm import is_success


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.submit", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--cluster", help=f"cluster YAML (default {DEFAULT_CLUSTER}; {LOCAL_CLUSTER} with --local)")
    p.add_argument("--train", default=DEFAULT_TRAIN, help=f"training YAML (default {DEFAULT_TRAIN})")
    p.add_argument("--task", choices=["train", "smoke"], default="train", help="what to run (default train)")
    p.add_argument("--nodes", type=int, help="number of nodes (each runs one task per GPU)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default from the cluster config)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--time-min", type=int, help="time limit in minutes (the job requeues itself past it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any cluster or train key, e.g. --set optim.lr=2e-4 --set env.NCCL_DEBUG=INFO")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="submit one run per value (a job array); several --sweep make a grid")
    p.add_argument("--name", help="run name; submitting the same name again resumes its checkpoints")
    p.add_argument("--dry-run", action="store_true", help="print the job, the plan and the sbatch script; submit nothing")
    p.add_argument("--local", action="store_true", help="run here with the local backend (no Slurm) and follow it")
    p.add_argument("--follow", action="store_true", help="stream rank 0's log until the job ends")
    p.add_argument("--force", action="store_true",
                   help="the run name has a live job: cancel it (it saves at the signal), wait, then submit")
    return p


def load_configs(args: argparse.Namespace):
    cluster_over, train_over = split_overrides(parse_set_args(args.set))
    return load_cluster_from_args(args, cluster_over), load_train(resolve(args.train), **train_over)


def sweep_grid(items: list[str] | Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """`["optim.lr=1e-4,2e-4", "seed=0,1"]` (or {"optim.lr": [1e-4, 2e-4], ...}) → every combination, in order.

    Only training keys can be swept: a job array shares one cluster shape.
    """
    pairs = ([(k, list(v)) for k, v in items.items()] if isinstance(items, Mapping)
             else [_parse_sweep_item(item) for item in items])
    axes = []
    for key, values in pairs:
        cluster_keys, _ = split_overrides({key: None})  # raises on unknown keys, with a suggestion
        if cluster_keys:
            raise ConfigError(f"--sweep {key}: only training keys can be swept (a job array shares one cluster "
                              f"shape); submit one job per {key} instead")
        if not values:
            raise ConfigError(f"--sweep {key}: no values; expected e.g. --sweep {key}=V1,V2")
        if len(set(map(str, values))) != len(values):
            raise ConfigError(f"--sweep {key}: repeated values in {values}")
        axes.append([(key, v) for v in values])
    if len({key for key, _ in pairs}) != len(pairs):
        raise ConfigError("--sweep: the same key is swept twice; put all its values in one --sweep KEY=V1,V2")
    return [dict(combo) for combo in itertools.product(*axes)]


def _parse_sweep_item(item: str) -> tuple[str, list[Any]]:
    key, sep, values = item.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2,... e.g. --sweep optim.lr=1e-4,2e-4")
    return key.strip(), [yaml.safe_load(v) for v in values.split(",") if v.strip()]


def sweep_trains(train, grid: list[dict[str, Any]]):
    """One train config per sweep point, and the points with each value as the config holds it
    (YAML reads `1e-4` as text; the config coerces it to 0.0001, which is what the runs record)."""
    trains = [load_train(train.to_dict(), **point) for point in grid]
    points = [{key: _lookup(t.to_dict(), key) for key in point} for t, point in zip(trains, grid)]
    return trains, points


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def point_name(point: Mapping[str, Any]) -> str:
    """A run folder name for a sweep point: `lr=0.0001,seed=1` (the last part of each key)."""
    short = [key.rsplit(".", 1)[-1] for key in point]
    keys = short if len(set(short)) == len(short) else list(point)
    text = ",".join(f"{k}={v}" for k, v in zip(keys, point.values()))
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def make_plan(cluster, train):
    return plan_for(cluster.nodes, int(cluster.tasks_per_node), train, gpu_memory_gb=cluster.gpu_memory_gb,
                    cpus_per_task=cluster.cpus_per_task, device=task_device(cluster))


def summary(cluster, run_dir: str) -> str:
    gres = cluster.gres_request or "none"
    where = f"partition {cluster.partition}" if cluster.partition else "default partition"
    return (f"job: {cluster.backend} backend, {where}, {cluster.nodes} node(s) × {cluster.tasks_per_node} tasks "
            f"= world size {cluster.world_size}; gres {gres}, {cluster.cpus_per_task} CPUs/task, "
            f"time {cluster.time_min} min, device {task_device(cluster)}\nrun folder: {run_dir}")


def submit_training(cluster, trains, run_name: str | None = None, sweep: list[dict] | None = None,
                    force: bool = False):
    """Submit one training run per train config (a job array for several); returns their JobHandles.

    sweep: the swept values of each config (one dict per config), recorded in the job registry and
    used for the run folder names (`<job_dir>/<run_name>/lr=0.0001/`).
    """
    from taehv_slurm.handle import submit_many
    from trainer.train import TrainTask

    trains = trains if isinstance(trains, list) else [trains]
    if sweep and len(sweep) != len(trains):
        raise ConfigError(f"submit_training: {len(trains)} train configs but {len(sweep)} sweep points")
    plans = [make_plan(cluster, t) for t in trains]
    tasks = [TrainTask(t.to_dict(), cluster.runtime()) for t in trains]
    records = [{"train": t.to_dict(), "plan": p.to_dict(), "sweep": point}
               for t, p, point in zip(trains, plans, sweep or [{}] * len(trains))]
    if len(tasks) == 1:
        names = [run_name] if run_name else None
    else:
        names = [point_name(point) for point in sweep] if sweep and all(sweep) else None
    return submit_many(tasks, cluster, names, extra_env=plans[0].nccl_env, records=records, group_name=run_name,
                       force=force)


def submit_sweep(cluster, train, grid: Mapping[str, Sequence[Any]] | list[str], run_name: str | None = None):
    """Submit one run per point of `grid` (e.g. {"optim.lr": [1e-4, 2e-4]}) as one job array; returns
    the JobHandles in grid order. Collect the results with `taehv_slurm.handle.runs_frame(handles)`."""
    trains, points = sweep_trains(train, sweep_grid(grid))
    return submit_training(cluster, trains, run_name or f"{train.name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}", points)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster, train = load_configs(args)
    if args.sweep and args.task != "train":
        raise ConfigError("--sweep applies to --task train")
    sweep: list[dict] = []
    trains = [train]
    if args.sweep:
        trains, sweep = sweep_trains(train, sweep_grid(args.sweep))
    plans = [make_plan(cluster, t) for t in trains] if args.task == "train" else [None]  # validates every point
    run_name = args.name or f"{train.name if args.task == 'train' else 'smoke'}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = str(Path(cluster.job_dir) / run_name)

    if args.dry_run:
        print(summary(cluster, run_dir))
        from taehv_slurm.security import describe_secret_env

        if secret_line := describe_secret_env(cluster):  # names only: values are masked, never printed
            print(secret_line)
        for point, plan in zip(sweep or [{}], plans):
            if plan is not None:
                print(f"\nplan{' for ' + str(point) if point else ''}:\n{plan.table()}")
        if cluster.backend == "slurm":
            env = plans[0].nccl_env if plans[0] else {}
            print(f"\nsbatch script ({run_dir}/submitit/):\n{sbatch_preview(cluster, Path(run_dir) / 'submitit', env)}")
        return 0

    if args.task == "smoke":
        from taehv_slurm.handle import submit
        from taehv_slurm.smoke import SmokeTask

        task = SmokeTask(backend=cluster.dist_backend, rendezvous_timeout_s=cluster.rendezvous_timeout_s)
        handles = [submit(task, cluster, run_name, requeueable=False, record={"task_kind": "smoke"}, force=args.force)]
    else:
        handles = submit_training(cluster, trains, run_name, sweep, force=args.force)
    for handle in handles:
        point = f" {point_name(handle.sweep)}" if handle.sweep else ""
        print(f"submitted job {handle.job_id}{point}: {cluster.nodes} node(s) × {cluster.tasks_per_node} tasks, "
              f"run folder {handle.run_dir}")
    if len(handles) > 1:
        ids = " ".join(h.job_id for h in handles)
        print(f"sweep of {len(handles)} runs (one job array): python -m jobs.status {ids} --job-dir {cluster.job_dir}")
    first = handles[0]
    print(f"logs: {first.log_path(0)} (rank 0) … {first.log_path(cluster.world_size - 1).name}")
    print(f"follow: python -m jobs.logs {first.job_id} --follow --job-dir {cluster.job_dir}")
    print(f"status: python -m jobs.status {first.job_id} --job-dir {cluster.job_dir}")
    if args.local or args.follow or cluster.backend == "local":
        state, interrupted = follow_to_the_end(first, stop_on_interrupt=cluster.backend == "local")
        report_end(first, state, run_name, interrupted)
        if args.task == "smoke" and is_success(state):
            for facts in sorted(first.results(), key=lambda f: f["rank"]):
                print(facts)
        return 0 if is_success(state) else 130 if interrupted else 1
    return 0


def follow_to_the_end(handle, stop_on_interrupt: bool) -> tuple[str, bool]:
    """Stream rank 0's log (tracebacks as one line each) until the job ends: (state, interrupted).

    Ctrl-C on a job of this machine stops it as a preemption would: every rank saves at its next step,
    then the job ends CANCELLED (a second Ctrl-C ends it without waiting). On a cluster Ctrl-C only
    stops following; the job runs on."""
    follower = LogFollower(handle, rank=0, hide_tracebacks=True)
    try:
        return follower.run(), False
    except KeyboardInterrupt:
        if not stop_on_interrupt:
            print(f"\nstopped following; job {handle.job_id} runs on (python -m jobs.logs {handle.job_id} --follow)")
            return handle.state, True
    print(f"\ninterrupted: every rank saves at its next step, then job {handle.job_id} ends "
          "(Ctrl-C again to end it without saving)", flush=True)
    handle.cancel()
    try:
        return follower.run(), True
    except KeyboardInterrupt:
        handle.cancel()  # a second stop signal: the controller ends the ranks at once
        return follower.run(), True


def report_end(handle, state: str, run_name: str, interrupted: bool) -> None:
    """The job's end in one or two lines: its state, and for a failure the error once and where the
    traceback is, for a stop where it was saved and how to resume."""
    print(f"job {handle.job_id} ended: {state}")
    if is_success(state):
        return
    if state.startswith("CANCELLED") or interrupted:
        saved = [e["step"] for e in handle.events() if e["event"] in ("cancelled", "requeue")]
        where = f"saved at step {saved[-1]}" if saved else "stopped before it saved a step"
        print(f"{where}; resume with: python -m jobs.submit --name {run_name} and the same flags", file=sys.stderr)
        return
    failure = [e for e in handle.events() if e["event"] in ("failure", "requeue_failed")]
    rank = failure[-1].get("rank", 0) if failure else 0
    print(f"error: {handle.error or 'the job ended ' + state}; full traceback: {handle.log_path(rank)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
