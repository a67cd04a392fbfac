"""Small callables the Slurm tests submit (importable on the nodes as tests.tasks)."""

from __future__ import annotations

from typing import Any

from taehv_slurm.checkpoint import Checkpointer


class CrashAfterStart:
    """Marks its start like the trainer does, then fails: a requeue loop with no progress."""

    def __call__(self, ctx: Any) -> None:
        ctx.started(Checkpointer(ctx.run_dir / "checkpoints").latest_step() or 0)
        raise RuntimeError("simulated crash right after the restart")


class StopAtFirstBoundary:
    """Starts at step 0 and, like the trainer, asks at the first step boundary whether to stop."""

    def __call__(self, ctx: Any) -> str:
        ctx.started(0)
        reason = ctx.should_stop()
        if reason:
            ctx.requeue_after_save(0, reason)  # nothing trained: the saved state is the one it started from
        ctx.finished(0)
        return "trained"
