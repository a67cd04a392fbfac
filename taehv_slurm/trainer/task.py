"""`TrainTask`: the picklable callable every rank runs to train TAEHV.

It holds plain values only (the train config as a dict, the runtime settings), so building and
pickling it on the submitting side imports no torch; the loop (taehv_slurm.trainer.train) is imported
when a rank calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from taehv_slurm.common.config import RuntimeSettings

if TYPE_CHECKING:
    from taehv_slurm.runtime.context import RunContext


class TrainTask:
    """Train TAEHV with `train` (a TrainConfig dict) under `runtime` (ClusterConfig.runtime()).

    RequeueableTask calls it with the job's RunContext; a task that builds its own TrainTask passes the
    context it got (`TrainTask(train, runtime)(ctx)`), so it saves into the job's run folder and at its
    signals. Called with no context it runs standalone: one process, `runtime.run_dir` or runs/<name>.
    """

    def __init__(self, train: Mapping[str, Any],
                 runtime: RuntimeSettings | Mapping[str, Any] | None = None) -> None:
        self.train = dict(train)
        self.runtime = RuntimeSettings.of(runtime)

    def __call__(self, ctx: RunContext | None = None) -> dict[str, Any]:
        from taehv_slurm.trainer.train import run_training

        return run_training(self.train, self.runtime, ctx)
