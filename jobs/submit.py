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
import sys
import time
from pathlib import Path

import yaml

from jobs._cli import one_line_errors, resolve
from taehv_slurm.config import ConfigError, load_cluster, load_train, parse_set_args, split_overrides
from taehv_slurm.executor import sbatch_preview
from taehv_slurm.plan import plan_for

DEFAULT_CLUSTER = "configs/cluster/h100_8gpu.yaml"
LOCAL_CLUSTER = "configs/cluster/local.yaml"
DEFAULT_TRAIN = "configs/train/taehv.yaml"


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
    return p


def load_configs(args: argparse.Namespace):
    overrides = parse_set_args(args.set)
    cluster_over, train_over = split_overrides(overrides)
    for key, value in (("nodes", args.nodes), ("gpus_per_node", args.gpus_per_node),
                       ("partition", args.partition), ("time_min", args.time_min)):
        if value is not None:
            cluster_over[key] = value
    if args.gpus_per_node is not None and "tasks_per_node" not in cluster_over:
        cluster_over["tasks_per_node"] = args.gpus_per_node or 1
    cluster_path = resolve(args.cluster or (LOCAL_CLUSTER if args.local else DEFAULT_CLUSTER))
    if args.local and args.cluster:
        cluster_over.setdefault("backend", "local")
    cluster = load_cluster(cluster_path, **cluster_over)
    train = load_train(resolve(args.train), **train_over)
    return cluster, train


def sweep_grid(items: list[str]) -> list[dict]:
    axes = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2,... e.g. --sweep optim.lr=1e-4,2e-4")
        axes.append([(key, yaml.safe_load(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def device_of(cluster) -> str:
    if cluster.device != "auto":
        return cluster.device
    if cluster.backend == "local":
        return "cuda" if cluster.gpus_per_node > 0 and any(Path("/dev").glob("nvidia[0-9]*")) else "cpu"
    return "cuda" if cluster.gpus_per_node > 0 else "cpu"


def make_plan(cluster, train):
    return plan_for(cluster.nodes, int(cluster.tasks_per_node), train, gpu_memory_gb=cluster.gpu_memory_gb,
                    cpus_per_task=cluster.cpus_per_task, device=device_of(cluster))


def summary(cluster, run_dir: str) -> str:
    gres = cluster.gres_request or "none"
    where = f"partition {cluster.partition}" if cluster.partition else "default partition"
    return (f"job: {cluster.backend} backend, {where}, {cluster.nodes} node(s) × {cluster.tasks_per_node} tasks "
            f"= world size {cluster.world_size}; gres {gres}, {cluster.cpus_per_task} CPUs/task, "
            f"time {cluster.time_min} min, device {device_of(cluster)}\nrun folder: {run_dir}")


def submit_training(cluster, trains, run_name: str | None = None, sweep: list[dict] | None = None):
    """Submit one training run per train config (a job array for several); returns their JobHandles."""
    from taehv_slurm.handle import submit_many
    from trainer.train import TrainTask

    trains = trains if isinstance(trains, list) else [trains]
    plans = [make_plan(cluster, t) for t in trains]
    tasks = [TrainTask(t.to_dict(), cluster.runtime()) for t in trains]
    records = [{"train": t.to_dict(), "plan": p.to_dict(), "sweep": point}
               for t, p, point in zip(trains, plans, sweep or [{}] * len(trains))]
    names = [run_name] if run_name and len(tasks) == 1 else None
    return submit_many(tasks, cluster, names, extra_env=plans[0].nccl_env, records=records, group_name=run_name)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster, train = load_configs(args)
    sweep = sweep_grid(args.sweep)
    trains = [load_train(train.to_dict(), **point) for point in sweep] if sweep else [train]
    plans = [make_plan(cluster, t) for t in trains] if args.task == "train" else [None]  # validates every point
    run_name = args.name or f"{train.name if args.task == 'train' else 'smoke'}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = str(Path(cluster.job_dir) / run_name)

    if args.dry_run:
        print(summary(cluster, run_dir))
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
        handles = [submit(task, cluster, run_name, requeueable=False, record={"task_kind": "smoke"})]
    else:
        handles = submit_training(cluster, trains, run_name, sweep)
    for handle in handles:
        print(f"submitted job {handle.job_id}: {cluster.nodes} node(s) × {cluster.tasks_per_node} tasks, run folder {handle.run_dir}")
    first = handles[0]
    print(f"logs: {first.log_path(0)} (rank 0) … {first.log_path(cluster.world_size - 1).name}")
    print(f"follow: python -m jobs.logs {first.job_id} --follow --job-dir {cluster.job_dir}")
    print(f"status: python -m jobs.status {first.job_id} --job-dir {cluster.job_dir}")
    if args.local or args.follow or cluster.backend == "local":
        from jobs.logs import follow

        state = follow(first, rank=0)
        print(f"job {first.job_id} ended: {state}")
        if args.task == "smoke":
            for facts in sorted(first.results(), key=lambda f: f["rank"]):
                print(facts)
        return 0 if state.split()[0] in ("COMPLETED", "FINISHED", "DONE") else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
