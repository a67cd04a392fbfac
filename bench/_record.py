"""What every benchmark records beside its figures, and where it writes them.

Each result file carries the machine and the versions it ran with (device, torch, CUDA, cuDNN, NCCL,
date), so a figure in docs/benchmarks.md can always be traced to where it was measured. `add_clip_shape`
gives the student benchmarks their clip, the shipped config's unless told otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHIPPED_TRAIN = RESULTS.parents[1] / "configs" / "train" / "taehv.yaml"


def add_clip_shape(parser: argparse.ArgumentParser) -> None:
    """--frames, --height, --width of the student's clips; by default configs/train/taehv.yaml's."""
    from taehv_slurm.config import load_train

    data = load_train(SHIPPED_TRAIN).data
    parser.add_argument("--frames", type=int, default=data.frames)
    parser.add_argument("--height", type=int, default=data.height)
    parser.add_argument("--width", type=int, default=data.width)


def kernel_bench_args(doc: str, iters: int, what_sweeps: str, smoke_path: str) -> argparse.Namespace:
    """The command line of a kernel micro-benchmark: a batch of the student's clips (the shipped shape),
    --iters, --sweep (``what_sweeps``), --out; --smoke shrinks it to one 4×32×32 clip and one iteration on CPU
    (``smoke_path`` only). ``on_gpu`` is set: a GPU is there and this is not a smoke run."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    add_clip_shape(p)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--sweep", action="store_true", help=f"also time {what_sweeps}")
    p.add_argument("--smoke", action="store_true", help=f"CPU, a 1×4×32×32 batch, {smoke_path} only")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.batch, args.frames, args.height, args.width, args.iters = 1, 4, 32, 32, 1
    args.on_gpu = torch.cuda.is_available() and not args.smoke
    return args


def add_cudnn_benchmark(parser: argparse.ArgumentParser) -> None:
    """--cudnn-benchmark (the trainer's setting, configure_backends) or --no-cudnn-benchmark (its heuristics:
    no timing of algorithms at each new shape, so a faster first step, perhaps a slower one after)."""
    parser.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                        help="cuDNN times its algorithms at each new shape (the trainer's setting)")


def run_info(on_gpu: bool, **extra: Any) -> dict[str, Any]:
    """The machine, versions and date of this run; `extra` adds the benchmark's own settings."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device": (torch.cuda.get_device_name(0) if on_gpu
                   else platform.processor() or platform.machine() or "cpu"),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None,
        **extra,
    }


def write_results(out: str | None, default_name: str, payload: dict[str, Any]) -> Path:
    """Write `payload` as JSON to `out`, or to bench/results/`default_name`; prints the path."""
    path = Path(out) if out else RESULTS / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return path
