"""Rank 0's metrics and the numbers behind them.

`LogWindow` sums a window of steps on the device (no host sync per step) and turns it into one log
line's numbers; `MetricsWriter` writes them to the run's metrics file (`RunFolder.metrics`; pandas reads
it), TensorBoard, the trackers and the progress display; `sample_grid` makes the validation's sample image.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.trainer.engine import StepMetrics
from taehv_slurm.trainer.stragglers import FIGURES, StepClock, device_anchor
from taehv_slurm.trainer.trackers import Trackers

log = logging.getLogger("taehv")


class LogWindow:
    """The steps since the last log line: metric sums kept on the device (no sync per step), the time this
    rank spent waiting for data, the steps whose update was skipped (their metrics are left out), and each
    step's clock where steps are timed (read at the log line)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.warned = False
        self._reset()

    def _reset(self) -> None:
        self.began = time.perf_counter()
        self.steps = 0
        self.data_wait_s = 0.0
        self.names: tuple[str, ...] = ()
        # per metric Σ over kept samples, then Σ grad norm, kept samples, kept steps, skipped steps
        self.sums: torch.Tensor | None = None
        self.clocks: list[StepClock] = []
        self.anchor = device_anchor(self.device)  # the window's GPU events on the host's clock (idle now)

    def add(self, m: StepMetrics, clock: StepClock | None = None) -> None:
        if clock is not None:
            self.clocks.append(clock)
        keep = (~m.skipped).to(torch.float64)
        vec = torch.cat([torch.nan_to_num(m.sums) * keep, (torch.nan_to_num(m.grad_norm) * keep).reshape(1),
                         (keep * m.samples).reshape(1), keep.reshape(1), (1 - keep).reshape(1)])
        self.names = m.names
        self.sums = vec if self.sums is None else self.sums + vec
        self.steps += 1

    def timings(self) -> list[list[float]] | None:
        """Every rank's means per step in this window, FIGURES in order (stragglers.py), by rank; None where
        steps are not timed. Collective: every rank calls it at the same log lines (they time alike)."""
        if not self.clocks:
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        steps = len(self.clocks)
        # waits for the steps' events
        sums = [sum(values) for values in zip(*(c.figures(self.anchor) for c in self.clocks))]
        mine = [(time.perf_counter() - self.began) / steps, *(v / steps for v in sums[1:])]
        every = torch.zeros(world, len(FIGURES), dtype=torch.float64, device=self.device)
        every[rank] = torch.tensor(mine, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(every)  # one small reduction per log line: each rank fills its own row
        return every.tolist()

    def close(self, effective_batch: int) -> dict[str, float | None]:
        """Per-sample means over every rank's kept samples (None when every step was skipped), clips/s,
        the skipped steps and the slowest rank's data-wait fraction; resets."""
        if self.sums is None:
            raise RuntimeError("LogWindow.close before any step")
        if self.device.type == "cuda":  # the window's GPU work done, not only queued (clips/s overstated it)
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.began
        totals = self.sums.clone()
        wait = torch.tensor([self.data_wait_s / elapsed], dtype=torch.float64, device=self.device)
        world = 1
        if dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()
            dist.all_reduce(totals)
            dist.all_reduce(wait, op=dist.ReduceOp.MAX)
        *sums, grad_norm, samples, kept, skipped = totals.tolist()
        kept, skipped = round(kept / world), round(skipped / world)  # the same on every rank
        out: dict[str, float | None] = {name: v / samples if samples else None
                                        for name, v in zip(self.names, sums)}
        out.update(grad_norm=grad_norm / (kept * world) if kept else None,
                   samples_per_second=self.steps * effective_batch / elapsed, data_wait=float(wait))
        if skipped:
            out["skipped_steps"] = skipped
        self._reset()
        return out


class MetricsWriter:
    """Rank 0's metrics: JSON lines (pandas reads them), TensorBoard, and a progress display.

    On resume, lines past the resumed step are dropped (they belong to work that was not saved), so
    each step appears once. Progress is a tqdm bar in a terminal or notebook, plain lines otherwise.
    """

    TB_TAGS = {"loss": "train/loss", "psnr": "train/psnr", "reconstruction_loss": "train/reconstruction_loss",
               "latent_loss": "train/latent_loss", "decoder_loss": "train/decoder_loss", "lr": "lr",
               "samples_per_second": "samples_per_second", "gpu_memory_gb": "gpu_memory",
               "grad_norm": "train/grad_norm", "mfu": "mfu"}

    def __init__(self, run_dir: Path, start_step: int, enabled: bool, total: int,
                 trackers: Trackers | None = None) -> None:
        self.enabled = enabled
        self.trackers = trackers  # W&B / MLflow (rank 0), fed the same tags as TensorBoard
        self.run_dir = run_dir
        self.log = RunFolder(run_dir).metrics()
        self.path = self.log.path
        self.samples_path = run_dir / "samples.jsonl"
        self.bar = None
        self.total = total
        if enabled:
            self._open(start_step)
            if trackers is not None and trackers.wants_replay:
                self._replay_to_trackers()

    def _open(self, start_step: int) -> None:
        """Drop what was logged past `start_step` (work that was not kept) and open the writers there."""
        for path in (self.path, self.samples_path):
            if path.exists():
                kept = [ln for ln in path.read_text().splitlines()
                        if _step_of(ln) is not None and _step_of(ln) <= start_step]
                path.write_text("".join(ln + "\n" for ln in kept))
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        if sys.stdout.isatty() or "ipykernel" in sys.modules:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=start_step, unit="step", desc="train")
        self.last_step = start_step

    def rewind(self, step: int) -> None:
        """The run went back to `step` (a rollback): what was logged after it is dropped."""
        if self.enabled:
            self._close_writers()
            self._open(step)  # the trackers go on (W&B ignores steps below its last one, MLflow keeps both)

    def write(self, step: int, values: Mapping[str, Any], prefix: str = "train") -> None:
        if not self.enabled:
            return
        values = {k: finite_or_none(v) for k, v in values.items()}
        row = {"step": step, "time": time.time(),
               **({f"val_{k}": v for k, v in values.items()} if prefix == "val" else values)}
        # not fsynced: rank 0 writes it inside the loop, where the other ranks would wait for a slow
        # filesystem's fsync; a line cut by a crash is skipped by every reader
        self.log.append(row, durable=False)
        scalars = self.tagged(values, prefix)
        for tag, value in scalars.items():
            self.tb.add_scalar(tag, value, step)
        if self.trackers is not None:
            self.trackers.log(step, scalars)
        text = " ".join(f"{k} {v:.4g}" for k, v in values.items() if isinstance(v, float))
        if self.bar is not None:
            self.bar.update(step - self.last_step)
            self.bar.set_postfix_str(text)
        else:
            log.info("%s step %d/%d %s", prefix, step, self.total, text)
        self.last_step = step

    @classmethod
    def tagged(cls, values: Mapping[str, Any], prefix: str = "train") -> dict[str, float]:
        """A metrics line's numbers by TensorBoard/tracker tag ("train/loss", "val/psnr", "lr", ...)."""
        return {f"val/{key}" if prefix == "val" else cls.TB_TAGS.get(key, f"train/{key}"): value
                for key, value in values.items()  # not None, not lists, not a rank number
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "late_rank"}

    def _replay_to_trackers(self) -> None:
        """Hand the trackers the lines this run kept before this attempt (Trackers.replay: W&B's service
        dies with a preempted attempt, and that attempt's unsent lines with it)."""
        lines = []
        for row in map(json.loads, self.path.read_text().splitlines() if self.path.exists() else []):
            val = {k.removeprefix("val_"): v for k, v in row.items() if k.startswith("val_")}
            values = val or {k: v for k, v in row.items() if k not in ("step", "time")}
            lines.append((row["step"], self.tagged(values, "val" if val else "train")))
        self.trackers.replay(lines)

    def write_image(self, step: int, tag: str, image: np.ndarray) -> None:
        """An H×W×3 uint8 image at `step`: TensorBoard and the trackers."""
        if self.enabled:
            self.tb.add_image(tag, image, step, dataformats="HWC")
            if self.trackers is not None:
                self.trackers.log_image(step, tag, image)

    def write_samples(self, step: int, samples: list[int]) -> None:
        if self.enabled:
            with self.samples_path.open("a") as f:
                f.write(json.dumps({"step": step, "samples": samples}) + "\n")

    def close(self, finished: bool = False) -> None:
        """End this attempt's writers; `finished`: training is complete (trackers mark their run done)."""
        if self.enabled:
            self._close_writers()
            if self.trackers is not None:
                self.trackers.close(finished)
            self.enabled = False

    def _close_writers(self) -> None:
        self.tb.flush()
        self.tb.close()
        if self.bar is not None:
            self.bar.close()


def sample_grid(frames: torch.Tensor, decoded: torch.Tensor, count: int) -> np.ndarray:
    """`count` evenly spaced frames of one clip (T×3×H×W in [0, 1]) above the same frames of its
    reconstruction, as one H×W×3 uint8 image (2 rows)."""
    frames_kept = min(frames.shape[0], decoded.shape[0])  # the decoder drops the clip's padded end
    picks = torch.linspace(0, frames_kept - 1, min(count, frames_kept)).round().long()
    rows = [torch.cat(list(clip[picks].float().cpu().clamp(0, 1)), dim=-1) for clip in (frames, decoded)]
    return (torch.cat(rows, dim=-2).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()


def finite_or_none(value: Any) -> Any:
    """A float that is NaN or infinite becomes None (JSON null); anything else is kept."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
