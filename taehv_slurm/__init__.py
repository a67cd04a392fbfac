"""taehv-slurm: train TAEHV on one GPU or many 8-GPU Slurm nodes, with checkpoint-requeue that loses no work.

The public API. Names load on first use: `python -m taehv_slurm.runtime.entry` (every task of every
job) must reach its signal handlers without first importing submitit and pandas, and torch is
imported only inside the functions that need it.

Where code runs, by folder: this package's modules run where you submit (the driver);
`taehv_slurm.runtime` runs on every rank; `taehv_slurm.trainer` is the training job itself;
`taehv_slurm.cli` is the `taehv` command (docs/design.md has the map).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from taehv_slurm.common import moved

moved.install()  # the old names of moved modules, for users' imports and jobs pickled before the move

_EXPORTS = {
    "Checkpointer": "runtime.checkpoint",
    "ClusterConfig": "config", "ConfigError": "config", "TrainConfig": "config", "load_cluster": "config",
    "load_train": "config",
    "DistEnv": "runtime.distenv", "init_distributed": "runtime.distenv",
    "make_executor": "executor", "sbatch_preview": "executor",
    "JobHandle": "handle", "submit": "submission", "submit_many": "submission",
    "submit_training": "training", "submit_sweep": "training", "submit_prepare": "training",
    "ScalePlan": "plan", "plan_for": "plan", "plan_for_cluster": "plan",
    "runs_frame": "runs", "status_frame": "runs", "accounting_frame": "runs", "plot_metrics": "reports",
    "RequeueableTask": "runtime.requeue", "RunContext": "runtime.context",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and IDEs (`X as X` marks a re-export)
    from taehv_slurm.common.config import ClusterConfig as ClusterConfig
    from taehv_slurm.common.config import ConfigError as ConfigError
    from taehv_slurm.common.config import TrainConfig as TrainConfig
    from taehv_slurm.common.config import load_cluster as load_cluster
    from taehv_slurm.common.config import load_train as load_train
    from taehv_slurm.common.plan import ScalePlan as ScalePlan
    from taehv_slurm.common.plan import plan_for as plan_for
    from taehv_slurm.common.plan import plan_for_cluster as plan_for_cluster
    from taehv_slurm.executor import make_executor as make_executor
    from taehv_slurm.executor import sbatch_preview as sbatch_preview
    from taehv_slurm.handle import JobHandle as JobHandle
    from taehv_slurm.reports import plot_metrics as plot_metrics
    from taehv_slurm.runs import accounting_frame as accounting_frame
    from taehv_slurm.runs import runs_frame as runs_frame
    from taehv_slurm.runs import status_frame as status_frame
    from taehv_slurm.runtime.checkpoint import Checkpointer as Checkpointer
    from taehv_slurm.runtime.context import RunContext as RunContext
    from taehv_slurm.runtime.distenv import DistEnv as DistEnv
    from taehv_slurm.runtime.distenv import init_distributed as init_distributed
    from taehv_slurm.runtime.requeue import RequeueableTask as RequeueableTask
    from taehv_slurm.submission import submit as submit
    from taehv_slurm.submission import submit_many as submit_many
    from taehv_slurm.training import submit_prepare as submit_prepare
    from taehv_slurm.training import submit_sweep as submit_sweep
    from taehv_slurm.training import submit_training as submit_training


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'taehv_slurm' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
