"""Rank 0's metrics and the numbers behind them.

`LogWindow` sums a window of steps on the device (no host sync per step) and turns it into one log
line's numbers; `MetricsWriter` writes them to metrics.jsonl (pandas reads it), TensorBoard and the
progress display.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from taehv_slurm.trainer.engine import StepMetrics

log = logging.getLogger("taehv")


class LogWindow:
    """The steps since the last log line: metric sums kept on the device (no sync per step), samples,
    and the time this rank spent waiting for data."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.warned = False
        self._reset()

    def _reset(self) -> None:
        self.began = time.perf_counter()
        self.steps = self.samples = 0
        self.data_wait_s = 0.0
        self.names: tuple[str, ...] = ()
        self.sums: torch.Tensor | None = None  # per metric Σ over samples, then Σ over steps of the grad norm

    def add(self, m: StepMetrics) -> None:
        vec = torch.cat([m.sums, m.grad_norm.reshape(1)])
        self.names = m.names
        self.sums = vec if self.sums is None else self.sums + vec
        self.steps += 1
        self.samples += m.samples

    def close(self, effective_batch: int) -> dict[str, float]:
        """Per-sample means over every rank's samples, clips/s and the slowest rank's data-wait fraction;
        resets."""
        if self.sums is None:
            raise RuntimeError("LogWindow.close before any step")
        elapsed = time.perf_counter() - self.began
        totals = torch.cat([self.sums, self.sums.new_tensor([float(self.samples)])])
        wait = torch.tensor([self.data_wait_s / elapsed], dtype=torch.float64, device=self.device)
        world = 1
        if dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()
            dist.all_reduce(totals)
            dist.all_reduce(wait, op=dist.ReduceOp.MAX)
        *sums, grad_norm, samples = totals.tolist()
        out = {name: v / samples for name, v in zip(self.names, sums)}
        out.update(grad_norm=grad_norm / (self.steps * world),
                   samples_per_second=self.steps * effective_batch / elapsed, data_wait=float(wait))
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
               "grad_norm": "train/grad_norm"}

    def __init__(self, run_dir: Path, start_step: int, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.bar = None
        self.total = total
        if not enabled:
            return
        self.samples_path = run_dir / "samples.jsonl"
        for path in (self.path, self.samples_path):
            if path.exists():
                kept = [ln for ln in path.read_text().splitlines()
                        if _step_of(ln) is not None and _step_of(ln) <= start_step]
                path.write_text("".join(ln + "\n" for ln in kept))
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        if sys.stdout.isatty() or "ipykernel" in sys.modules:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start_step, unit="step", desc="train")
        self.last_step = start_step

    def write(self, step: int, values: Mapping[str, Any], prefix: str = "train") -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(),
               **({f"val_{k}": v for k, v in values.items()} if prefix == "val" else values)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in values.items():
            if value is None:
                continue
            tag = f"val/{key}" if prefix == "val" else self.TB_TAGS.get(key, f"train/{key}")
            self.tb.add_scalar(tag, value, step)
        text = " ".join(f"{k} {v:.4g}" for k, v in values.items() if isinstance(v, float))
        if self.bar is not None:
            self.bar.update(step - self.last_step)
            self.bar.set_postfix_str(text)
        else:
            log.info("%s step %d/%d %s", prefix, step, self.total, text)
        self.last_step = step

    def write_samples(self, step: int, samples: list[int]) -> None:
        if self.enabled:
            with self.samples_path.open("a") as f:
                f.write(json.dumps({"step": step, "samples": samples}) + "\n")

    def close(self) -> None:
        if self.enabled:
            self.tb.flush()
            self.tb.close()
            if self.bar is not None:
                self.bar.close()
            self.enabled = False


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
