"""The divergence guard: a non-finite loss or gradient is never applied, and a run that keeps producing
them stops (or rolls back) instead of training on garbage.

The engine decides each step, on the device and identically on every rank, whether the update was
skipped (a non-finite loss on any rank or a non-finite global gradient norm; taehv_slurm.trainer.engine).
This guard reads that flag one step late on a GPU (the host never waits for the step it just queued),
counts the skipped steps, and once the budget is spent — `max_consecutive` in a row, or `max_in_window`
within the last `window` steps — answers what to do: "stop" or "rollback" (`action: rollback`, at most
`max_rollbacks` times, then stop). Every rank reads the same flags, so every rank decides the same at
the same step, without a collective of its own. Large-model trainers do the same (Megatron-LM skips
non-finite iterations and can re-run or skip their batches; torchtitan checks the loss for NaN).
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from taehv_slurm.common.config import DivergenceConfig

log = logging.getLogger("taehv")


class DivergenceGuard:
    """Counts the skipped steps of a run segment; `observe` returns "stop" or "rollback" when the budget
    is spent, else None."""

    def __init__(self, cfg: DivergenceConfig, device: torch.device, rollbacks_done: int = 0) -> None:
        self.cfg, self.device = cfg, device
        self.rollbacks_done = rollbacks_done
        self.total = 0  # skipped steps in this segment
        self.consecutive = 0
        self.recent: deque[int] = deque()  # skipped steps within the window
        self.last_skipped: int | None = None
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event] | None = None
        if device.type == "cuda":
            self._buffers = [torch.zeros((), dtype=torch.bool, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]

    def observe(self, step: int, skipped: torch.Tensor) -> str | None:
        """`skipped`: the engine's device flag for optimizer step `step` (0-based). On a GPU the flag of
        the previous step is read (it is done by now) and this one is kept for the next call."""
        if self.device.type != "cuda":
            return self._count(step, bool(skipped))
        slot = step % 2
        self._buffers[slot].copy_(skipped, non_blocking=True)
        self._events[slot].record()
        previous, self._pending = self._pending, (step, self._buffers[slot], self._events[slot])
        return self._resolve(previous)

    def flush(self) -> str | None:
        """Read the newest pending flag now (before a save, or at the end of the run)."""
        pending, self._pending = self._pending, None
        return self._resolve(pending)

    def _resolve(self, pending: tuple[int, torch.Tensor, torch.cuda.Event] | None) -> str | None:
        if pending is None:
            return None
        step, flag, event = pending
        event.synchronize()
        return self._count(step, bool(flag))

    def _count(self, step: int, skipped: bool) -> str | None:
        while self.recent and self.recent[0] <= step - self.cfg.window:
            self.recent.popleft()
        if not skipped:
            self.consecutive = 0
            return None
        self.total += 1
        self.consecutive += 1
        self.recent.append(step)
        self.last_skipped = step
        log.warning("step %d: the loss or gradient norm is not finite: the update was skipped on every rank "
                    "(%d in a row, %d in the last %d steps)", step + 1, self.consecutive, len(self.recent),
                    self.cfg.window)
        if self.consecutive < self.cfg.max_consecutive and len(self.recent) < self.cfg.max_in_window:
            return None
        if self.cfg.action == "rollback" and self.rollbacks_done < self.cfg.max_rollbacks:
            return "rollback"
        return "stop"

    @property
    def first_bad_step(self) -> int | None:
        """The first skipped step (0-based) counted in the spent budget: the state before it was clean."""
        return self.recent[0] if self.recent else self.last_skipped

    def spent(self) -> str:
        """Which budget ran out, in words, for the stop message."""
        if self.consecutive >= self.cfg.max_consecutive:
            return (f"was not finite in {self.consecutive} steps in a row "
                    f"(divergence.max_consecutive={self.cfg.max_consecutive})")
        return (f"was not finite in {len(self.recent)} of the last {self.cfg.window} steps "
                f"(divergence.max_in_window={self.cfg.max_in_window})")

    def rolled_back(self) -> None:
        """After a rollback: the budget starts afresh on the restored state."""
        self.rollbacks_done += 1
        self.consecutive = 0
        self.recent.clear()
        self._pending = None
