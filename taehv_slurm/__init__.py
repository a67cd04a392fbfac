"""taehv-slurm: train TAEHV on one GPU or many 8-GPU Slurm nodes, with checkpoint-requeue that loses no work.

The public API. Names load on first use: `python -m taehv_slurm.entry` (every task of every job)
must reach its signal handlers without first importing submitit and pandas, and torch is imported
only inside the functions that need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Checkpointer": "checkpoint",
    "ClusterConfig": "config", "ConfigError": "config", "TrainConfig": "config", "load_cluster": "config",
    "load_train": "config",
    "DistEnv": "distenv", "init_distributed": "distenv",
    "make_executor": "executor", "sbatch_preview": "executor",
    "JobHandle": "handle", "submit": "submission", "submit_many": "submission",
    "ScalePlan": "plan", "plan_for": "plan", "plan_for_cluster": "plan",
    "runs_frame": "reports", "plot_metrics": "reports",
    "RequeueableTask": "requeue", "RunContext": "requeue",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and IDEs (`X as X` marks a re-export)
    from .checkpoint import Checkpointer as Checkpointer
    from .config import ClusterConfig as ClusterConfig
    from .config import ConfigError as ConfigError
    from .config import TrainConfig as TrainConfig
    from .config import load_cluster as load_cluster
    from .config import load_train as load_train
    from .distenv import DistEnv as DistEnv
    from .distenv import init_distributed as init_distributed
    from .executor import make_executor as make_executor
    from .executor import sbatch_preview as sbatch_preview
    from .handle import JobHandle as JobHandle
    from .plan import ScalePlan as ScalePlan
    from .plan import plan_for as plan_for
    from .plan import plan_for_cluster as plan_for_cluster
    from .reports import plot_metrics as plot_metrics
    from .reports import runs_frame as runs_frame
    from .requeue import RequeueableTask as RequeueableTask
    from .requeue import RunContext as RunContext
    from .submission import submit as submit
    from .submission import submit_many as submit_many


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'taehv_slurm' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
