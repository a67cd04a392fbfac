"""taehv-slurm: train TAEHV on one GPU or many 8-GPU Slurm nodes, with checkpoint-requeue that loses no work.

The public API (torch is imported only inside the functions that need it):
"""

from .checkpoint import Checkpointer
from .config import ClusterConfig, ConfigError, TrainConfig, load_cluster, load_train
from .distenv import DistEnv, init_distributed
from .executor import make_executor, sbatch_preview
from .handle import JobHandle, submit, submit_many
from .plan import ScalePlan, plan_for
from .requeue import RequeueableTask, RunContext

__all__ = [
    "Checkpointer", "ClusterConfig", "ConfigError", "DistEnv", "JobHandle", "RequeueableTask", "RunContext",
    "ScalePlan", "TrainConfig", "init_distributed", "load_cluster", "load_train", "make_executor", "plan_for",
    "sbatch_preview", "submit", "submit_many",
]
