"""Submit training from Python (notebooks, scripts, the CLI): one run, or a sweep as one job array.

    from taehv_slurm import load_cluster, load_train
    from trainer.submit import submit_training, submit_sweep
    job = submit_training(load_cluster("configs/cluster/local.yaml"), load_train("configs/train/tiny.yaml"), "run1")[0]
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from taehv_slurm.checkpoint import Checkpointer
from taehv_slurm.config import ClusterConfig, ConfigError, TrainConfig
from taehv_slurm.handle import JobHandle
from taehv_slurm.plan import plan_for_cluster
from taehv_slurm.submission import submit_many
from taehv_slurm.sweep import point_name, sweep_grid, sweep_trains

from .train import TrainTask


class RunCompleteError(RuntimeError):
    """Every step of the run is already trained and saved; the message says how to train on."""


def submit_training(cluster: ClusterConfig, trains: TrainConfig | list[TrainConfig], run_name: str | None = None,
                    sweep: list[dict[str, Any]] | None = None, force: bool = False) -> list[JobHandle]:
    """Submit one training run per train config (a job array for several); returns their JobHandles.

    sweep: the swept values of each config (one dict per config), recorded in the job registry and
    used for the run folder names (`<job_dir>/<run_name>/lr=0.0001/`). force: see taehv_slurm.submission.
    """
    trains = trains if isinstance(trains, list) else [trains]
    if sweep and len(sweep) != len(trains):
        raise ConfigError(f"submit_training: {len(trains)} train configs but {len(sweep)} sweep points")
    plans = [plan_for_cluster(cluster, t) for t in trains]
    tasks = [TrainTask(t.to_dict(), cluster.runtime()) for t in trains]
    records = [{"train": t.to_dict(), "plan": p.to_dict(), "sweep": point}
               for t, p, point in zip(trains, plans, sweep or [{}] * len(trains))]
    if len(tasks) == 1:
        names = [run_name] if run_name else None
        dirs = [Path(cluster.job_dir) / run_name] if run_name else []
    else:
        names = [point_name(point) for point in sweep] if sweep and all(sweep) else None
        dirs = [Path(cluster.job_dir) / run_name / n for n in names] if run_name and names else []
    check_not_complete(dirs, trains)
    return submit_many(tasks, cluster, names, extra_env=plans[0].nccl_env, records=records, group_name=run_name,
                       force=force)


def submit_sweep(cluster: ClusterConfig, train: TrainConfig, grid: Mapping[str, Sequence[Any]] | list[str],
                 run_name: str | None = None) -> list[JobHandle]:
    """Submit one run per point of `grid` (e.g. {"optim.lr": [1e-4, 2e-4]}) as one job array; returns
    the JobHandles in grid order. Collect the results with `taehv_slurm.runs_frame(handles)`."""
    trains, points = sweep_trains(train, sweep_grid(grid))
    return submit_training(cluster, trains, run_name or f"{train.name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}", points)


def check_not_complete(run_dirs: Sequence[Path], trains: Sequence[TrainConfig]) -> None:
    """Refuse to resubmit runs whose latest checkpoint is already at their last step (a job would only
    load it and end); RunCompleteError names them and how to train on."""
    done = []
    for run_dir, train in zip(run_dirs, trains):
        step = Checkpointer(run_dir / "checkpoints").latest_step()
        if step is not None and step >= train.steps:
            done.append((run_dir, step, train.steps))
    if done:
        runs = ", ".join(f"{d.name} (step {step} of {steps})" for d, step, steps in done)
        longer = max(steps for _, _, steps in done) * 2
        raise RunCompleteError(f"{'run' if len(done) == 1 else 'runs'} {runs} already trained every step; nothing "
                               f"submitted. To train on, submit again with more steps (e.g. --set steps={longer}: the "
                               "lr schedule is recomputed for the new length), or use another --name for a new run")
