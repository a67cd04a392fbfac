"""What every benchmark records beside its figures, and where it writes them.

Each result file carries the machine, the versions and the code it ran with (device, torch, CUDA, cuDNN,
NCCL, date, the git commit and whether the tree had uncommitted changes), so a figure in
docs/benchmarks.md can always be traced to where and on what it was measured. Its default name is
`bench/results/<bench>_<gpu>_<date>_<commit>.json` (`result_name`; bench/results/README.md indexes them);
a second run of one benchmark on the same GPU kind, day and commit would replace the first, so give it
`--out` a name of its own (bench/run_gpu_benchmarks.sh does).
`add_clip_shape` gives the student benchmarks their clip, the shipped config's unless told otherwise.
torch is imported only by the functions that need it, so CPU-only benchmarks of the CLI do not load it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SHIPPED_TRAIN = RESULTS.parents[1] / "configs" / "train" / "taehv.yaml"


def add_clip_shape(parser: argparse.ArgumentParser) -> None:
    """--frames, --height, --width of the student's clips; by default configs/train/taehv.yaml's."""
    from taehv_slurm.common.config import load_train

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
    import torch

    if args.smoke:
        args.batch, args.frames, args.height, args.width, args.iters = 1, 4, 32, 32, 1
    args.on_gpu = torch.cuda.is_available() and not args.smoke
    return args


def add_cudnn_benchmark(parser: argparse.ArgumentParser) -> None:
    """--cudnn-benchmark (the trainer's setting, configure_backends) or --no-cudnn-benchmark (its heuristics:
    no timing of algorithms at each new shape, so a faster first step, perhaps a slower one after)."""
    parser.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                        help="cuDNN times its algorithms at each new shape (the trainer's setting)")
    parser.add_argument("--cudnn-benchmark-limit", type=int, default=None, metavar="N",
                        help="with --cudnn-benchmark: time at most N of cuDNN's candidate algorithms "
                             "(0: all of them; default torch's, 10)")


def code_version() -> dict[str, Any]:
    """The code a run measured: `git rev-parse --short HEAD` of this checkout and whether its tracked files
    had uncommitted changes (then the figure is of the commit plus those changes). None outside a checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=RESULTS.parents[1], capture_output=True, text=True,
                              timeout=30)

    try:
        head = git("rev-parse", "--short", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if head.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def run_info(on_gpu: bool, **extra: Any) -> dict[str, Any]:
    """The machine, versions, code and date of this run; `extra` adds the benchmark's own settings."""
    import torch

    from taehv_slurm.trainer.layers import FAST_PATHS_OFF_ENV

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
        **code_version(),
        "fast_paths_off": os.environ.get(FAST_PATHS_OFF_ENV, ""),  # an A/B's side
        "inductor_env": {k: v for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_")},
        **extra,
    }


def gpu_label(device: str, gpus: int = 1) -> str:
    """The `<gpu>` of a result's name: the model number in a GPU's name ('h100', 'h200', 'a100'; else the
    name as one lower-case word), 'cpu' for a run without a GPU; '4xh200' for a run over 4 GPUs."""
    if device.startswith(("NVIDIA", "AMD")):
        model = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", device)
        label = model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "", device.lower())
    else:
        return "cpu"
    return f"{gpus}x{label}" if gpus > 1 else label


def result_name(bench: str, info: dict[str, Any], gpus: int = 1, suffix: str = ".json") -> str:
    """`<bench>_<gpu>_<date>_<commit><suffix>`, e.g. 'train_throughput_h200_2026-11-27_d93ee1d.json'.
    The commit gets '-dirty' when the tree had uncommitted changes, 'nogit' outside a checkout."""
    commit = (info.get("commit") or "nogit") + ("-dirty" if info.get("dirty") else "")
    return f"{bench}_{gpu_label(str(info.get('device', '')), gpus)}_{str(info['date'])[:10]}_{commit}{suffix}"


def write_results(out: str | None, bench: str, payload: dict[str, Any], gpus: int = 1) -> Path:
    """Write `payload` as JSON to the file `out`, or as <bench>_<gpu>_<date>_<commit>.json into the folder
    `out` (an existing one, or a path ending in '/'), by default bench/results/ (its `info`, or the payload
    itself, holds `run_info`); prints the path."""
    info = payload.get("info", payload)
    folder = Path(out) if out and (out.endswith("/") or Path(out).is_dir()) else None if out else RESULTS
    path = folder / result_name(bench, info, gpus) if folder else Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return path
