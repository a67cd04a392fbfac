"""The learning-rate schedule: a pure function of the step, so the step saved with a checkpoint is its whole
state."""

from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to base_lr, then cosine decay to base_lr × min_lr_ratio at total_steps.

    A pure function of the step: the schedule's whole state is the step, saved with the checkpoint.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
