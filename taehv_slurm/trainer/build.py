"""What the training loop is built from: the data sources, the device and its kernel choices, the model
shape a checkpoint must match, and the advice for a loop that waits for its data."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from taehv_slurm.common.changes import refusals
from taehv_slurm.common.config import TrainConfig
from taehv_slurm.common.messages import command
from taehv_slurm.common.plan import ScalePlan
from taehv_slurm.runtime.distenv import DistEnv
from taehv_slurm.trainer.data import ClipSpec, SyntheticClips, VideoFolderClips


class IncompatibleCheckpointError(ValueError):
    """The checkpoint was trained with another model shape; the message names the fields."""


def build_sources(cfg: TrainConfig):
    """(train source, validation source) for the configured data."""
    d = cfg.data
    spec = ClipSpec(d.frames, d.height, d.width)
    if d.source == "synthetic":
        return (SyntheticClips(d.num_clips, spec, cfg.seed),
                SyntheticClips(max(1, d.val_clips), spec, cfg.seed + 7919))
    if d.source == "video":
        clips = VideoFolderClips(d.path or "", spec, seed=cfg.seed)
    else:
        from taehv_slurm.trainer.prepared import PreparedClips

        clips = PreparedClips(d.path or "", spec)
    n_val = min(d.val_clips, max(0, len(clips) - 1))
    train_idx = list(range(len(clips) - n_val))
    val_idx = list(range(len(clips) - n_val, len(clips)))
    return torch.utils.data.Subset(clips, train_idx), torch.utils.data.Subset(clips, val_idx)


def check_compatible(meta: Mapping[str, Any], cfg: TrainConfig, where: Path) -> None:
    """The checkpoint's config (its model shape, older releases: only that) against this run's config;
    the same refusals the login node gave before submitting (taehv_slurm.common.changes)."""
    saved = meta.get("config") or {"model": meta.get("model", {})}
    if problems := refusals(saved, cfg.to_dict(), f"checkpoint {where}"):
        raise IncompatibleCheckpointError("; ".join(problems))


def configure_backends(device: torch.device) -> None:
    """Kernel choices for training on `device`: cuDNN tries its algorithms once per input shape and keeps
    the fastest (a rank sees at most three shapes: the micro-batch, a smaller last one, validation)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def device_for(choice: str, env: DistEnv) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", env.local_rank)


def data_wait_advice(fraction: float, plan: ScalePlan, source: str) -> str:
    """One line for a trainer that waits for its data: how much, and what to change."""
    fix = {"video": f"or prepare the data once ({command('prepare')}) and train with data.source: prepared",
           "synthetic": "(synthetic clips are rendered on the CPU: each worker needs a core)",
           "prepared": "or move the shards to faster storage"}.get(source, "")
    return (f"the ranks waited for data {100 * fraction:.0f} % of the last log window with "
            f"{plan.num_workers} loader "
            f"workers per rank: raise cpus_per_task (the plan gives a worker per spare core) or set "
            f"data.num_workers {fix}")


def gpu_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


