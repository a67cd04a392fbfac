"""Every submitit name we use beyond its documented API, in one place (tested with submitit 1.5.x;
setup.cfg pins submitit>=1.5,<1.6 so an untested release is not picked up silently).

- `make_sbatch_string`: the sbatch text submitit writes, for `--dry-run` (sbatch_preview).
- `convert_mem`: GB → sbatch's `--mem` text, as submitit's own executor does.
- `JobPaths`: the per-job file names (`<job>_<rank>_log.out`, result pickles).
- `FailedJobError`: what submitit raises when sbatch exits non-zero.
- `process_job`: submitit's task entry, called by ours after its checks (taehv_slurm.entry).
- Overridden by subclassing: `Executor._submitit_command_str` (every task starts with our entry point)
  and `LocalExecutor._submit_command` (the local backend starts our controller, taehv_slurm.local).
"""

from __future__ import annotations

from typing import Any

from submitit.core.utils import FailedJobError, JobPaths
from submitit.slurm.slurm import _convert_mem as convert_mem
from submitit.slurm.slurm import _make_sbatch_string as make_sbatch_string

__all__ = ["FailedJobError", "JobPaths", "convert_mem", "make_sbatch_string"]  # and process_job, below


def __getattr__(name: str) -> Any:
    """`process_job` on first use: its module imports numpy, which only a rank needs, not the CLI."""
    if name == "process_job":
        from submitit.core.submission import process_job

        return process_job
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
