"""Submit this project's runs from Python, the CLI or a notebook: training (one run, or a sweep as one
job array) and teacher-latent preparation.

    from taehv_slurm import load_cluster, load_train, submit_training
    job = submit_training(load_cluster("configs/cluster/local.yaml"), load_train("configs/train/tiny.yaml"),
                          "run1")[0]

The tasks are named by import path (`TaskRef`): the trainer is imported on the ranks, never here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from taehv_slurm.backends import backend_named
from taehv_slurm.common.config import (
    ClusterConfig,
    ConfigError,
    TrainConfig,
    missing_engine_package,
    missing_tracker_package,
)
from taehv_slurm.common.plan import ScalePlan, plan_for_cluster
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.handle import JobHandle
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.runtime.context import grace_seconds
from taehv_slurm.runtime.tasks import TaskRef
from taehv_slurm.slurm_checks import not_checked_rows
from taehv_slurm.submission import SubmissionError, check_target, submit, submit_many
from taehv_slurm.submit_checks import Row, require_passing, submit_checks
from taehv_slurm.sweep import point_name, sweep_grid, sweep_trains

TRAIN_TASK = "taehv_slurm.trainer.task:TrainTask"
PREPARE_TASK = "taehv_slurm.trainer.prepare_task:PrepareTask"


class RunCompleteError(RuntimeError):
    """Every step of the run is already trained and saved; the message says how to train on."""


def submit_training(cluster: ClusterConfig, trains: TrainConfig | list[TrainConfig],
                    run_name: str | None = None, sweep: list[dict[str, Any]] | None = None,
                    force: bool = False, plans: list[ScalePlan] | None = None,
                    checks: Sequence[Row] | None = None) -> list[JobHandle]:
    """Submit one training run per train config (a job array for several); returns their JobHandles.

    sweep: the swept values of each config (one dict per config), recorded in the job registry and
    used for the run folder names (`<job_dir>/<run_name>/lr=0.0001/`). force: see taehv_slurm.submission.
    plans: the configs' plans for this cluster, if the caller has them already (else computed here).
    checks: the submit-time checks' rows if the caller ran them (`training_checks`), else they run here;
    a FAIL raises ChecksFailedError (one line per problem) and nothing is submitted.
    """
    trains = trains if isinstance(trains, list) else [trains]
    if sweep and len(sweep) != len(trains):
        raise ConfigError(f"submit_training: {len(trains)} train configs but {len(sweep)} sweep points")
    plans = plans or [plan_for_cluster(cluster, t) for t in trains]
    names, dirs = run_folders(cluster, len(trains), run_name, sweep)
    require_passing(training_checks(cluster, trains, plans, run_name, sweep) if checks is None else checks)
    tasks = [TaskRef(TRAIN_TASK, train=t.to_dict(), runtime=cluster.runtime()) for t in trains]
    records = [{"train": t.to_dict(), "plan": p.to_dict(), "sweep": point}
               for t, p, point in zip(trains, plans, sweep or [{}] * len(trains))]
    check_not_complete(dirs, trains)
    return submit_many(tasks, cluster, names, extra_env=plans[0].nccl_env, records=records,
                       group_name=run_name,
                       force=force)


def training_checks(cluster: ClusterConfig, trains: Sequence[TrainConfig], plans: Sequence[ScalePlan],
                    run_name: str | None, sweep: list[dict[str, Any]] | None = None,
                    data: bool | None = None, preview: bool = False) -> list[Row]:
    """The submit-time checks of these runs (taehv_slurm.submit_checks); nothing is written. Raises
    ConfigError for a bad run name or job_dir, or a missing engine package; where the backend cannot be used
    from here (no Slurm) see `reachable_rows`."""
    unreachable = reachable_rows(cluster, preview)
    check_target(cluster, [run_name])
    # the jobs' python is ours
    if cluster.python is None and (missing := missing_engine_package(plans[0].engine)
                                   or missing_tracker_package(trains[0].tracking)):
        raise ConfigError(missing)
    return (submit_checks(cluster, trains, plans, run_folders(cluster, len(trains), run_name, sweep)[1], data)
            + unreachable)


def reachable_rows(cluster: ClusterConfig, preview: bool = False) -> list[Row]:
    """No rows where the cluster's backend can be used from here. Where it cannot (no Slurm): a
    SubmissionError in one line (the other checks would not matter yet), or for a preview (a dry run) the
    rows only Slurm could answer, each `not checked here (no Slurm)`; the rest is checked as on a login
    node."""
    reason = backend_named(cluster.backend).unavailable_reason()
    if reason is None:
        return []
    if not preview:
        raise SubmissionError(reason)
    return not_checked_rows(cluster, reason)


def run_folders(cluster: ClusterConfig, count: int, run_name: str | None,
                sweep: list[dict[str, Any]] | None) -> tuple[list[str] | None, list[Path]]:
    """(names for submit_many, the run folders where the name fixes them) of `count` runs."""
    if count == 1:
        return ([run_name], [Path(cluster.job_dir) / run_name]) if run_name else (None, [])
    names = [point_name(point) for point in sweep] if sweep and all(sweep) else None
    return names, ([Path(cluster.job_dir) / run_name / n for n in names] if run_name and names else [])


def submit_sweep(cluster: ClusterConfig, train: TrainConfig, grid: Mapping[str, Sequence[Any]] | list[str],
                 run_name: str | None = None) -> list[JobHandle]:
    """Submit one run per point of `grid` (e.g. {"optim.lr": [1e-4, 2e-4]}) as one job array; returns
    the JobHandles in grid order. Collect the results with `taehv_slurm.runs_frame(handles)`."""
    trains, points = sweep_trains(train, sweep_grid(grid))
    return submit_training(cluster, trains,
                           run_name or f"{train.name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}", points)


def check_not_complete(run_dirs: Sequence[Path], trains: Sequence[TrainConfig]) -> None:
    """Refuse to resubmit runs whose latest checkpoint is already at their last step (a job would only
    load it and end); RunCompleteError names them and how to train on."""
    done = []
    for run_dir, train in zip(run_dirs, trains):
        step = Checkpointer(RunFolder(run_dir).checkpoints).latest_step()
        if step is not None and step >= train.steps:
            done.append((run_dir, step, train.steps))
    if done:
        runs = ", ".join(f"{d.name} (step {step} of {steps})" for d, step, steps in done)
        longer = max(steps for _, _, steps in done) * 2
        raise RunCompleteError(f"{'run' if len(done) == 1 else 'runs'} {runs} already trained every step; "
                               "nothing submitted. To train on, submit again with more steps "
                               f"(e.g. --set steps={longer}: the lr schedule is recomputed for the new "
                               "length), or use another --name for a new run")


def submit_prepare(cluster: ClusterConfig, out: str | os.PathLike, shards: int, run_name: str | None = None,
                   batch: int = 2, workers: int | None = None, compile: bool = True) -> JobHandle:
    """Submit the preparation of `out` (its window list of `shards` shards already written) as one job."""
    # After a signal a shard in progress is finished only if that fits well inside the signal's grace
    # (half of it: the save, the requeue and the exit need the rest).
    budget = {reason: seconds / 2
              for reason, seconds in grace_seconds(cluster.signal_delay_s, cluster.kill_wait_s).items()}
    # The device follows the cluster shape: ranks of a GPU-less config stay on the CPU even where CUDA exists.
    runtime = cluster.runtime(device=cluster.task_device())
    out = Path(out).resolve()
    task = TaskRef(PREPARE_TASK, out=str(out), runtime=runtime, batch=batch, workers=workers, compile=compile,
                   finish_budget_s=budget)
    name = run_name or f"prepare-{out.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # manifest.total_steps: taehv status and JobHandle.wait show shards done / shards (rank 0 logs them as
    # steps)
    record = {"task_kind": "prepare", "out": str(out), "plan": {"total_steps": shards}}
    return submit(task, cluster, name, record=record)
