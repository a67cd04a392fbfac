"""Start to the first training step on a warm compile cache, isolated: the shipped student built and
compiled as the trainer does (`use_compile_cache`, then the all-reduce engine with torch.compile), in fresh
processes on one cache folder: the first fills it (cold), the next ones start from it (warm).

    python bench/compile_start.py               # GPU: shipped shape, bf16, channels-last, CUDA graphs
    python bench/compile_start.py --ab          # ... and the code before (below), one cache folder each
    python bench/compile_start.py --height 32 --width 32 --mode default --ab   # CPU (inductor's C++)

Each process starts as a rank does: it keeps Python's bytecode in the cache folder where the environment
turns bytecode off (`runtime/bytecode.py`), and a step is --grad-accum micro-batches (the plan's 32 on one
GPU). It reports its imports, its model and engine build, its first step (Dynamo, the caches' lookups or
the compile, the first run), its second step, torch's cache counters (`aot_autograd`: hit, miss or
bypass), torch's timers of the compile's phases (`compile_phases_s`, those of 0.1 s or more) and the first
step's timeline (`first_step_parts_s`): the first micro-batch's forward (Dynamo, the compile or the caches'
loads, the first run) and backward, the second micro-batch (where CUDA graphs are recorded), the other
micro-batches with the gradient clip and optimizer update; the two steps' losses (the same in every
start) and how the compiled student came (`precompiled`: loaded, saved, or torch.compile's own path where
the fast path `precompile` is off, `TAEHV_FAST_PATHS_OFF=precompile`). The user's figure, job start to first
step through `jobs.submit`, is bench/e2e_throughput.py's `first_step_s`.

"before" (--ab) undoes two changes of 2026-11-27: the model's autocast blocks marked cacheable
(`AUTOCAST_IN_GRAPH`; torch >= 2.12 bypassed its AOT autograd cache without it) and the all-reduce
engine's gradients as windows of its buffer instead of autograd views (torch.compile fakes each .grad).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_start(args: argparse.Namespace) -> dict:
    """This process: build, compile and run two steps as a rank does; times from the process's start."""
    from taehv_slurm.runtime.bytecode import keep_bytecode

    keep_bytecode(args.cache)  # before torch, as a rank (runtime/entry.py)
    import torch
    from torch._dynamo.utils import compile_times, counters

    from taehv_slurm.trainer.build import configure_backends
    from taehv_slurm.trainer.engine import Microbatch, make_engine
    from taehv_slurm.trainer.losses import DistillModule
    from taehv_slurm.trainer.model import TAEHV, TAEHVConfig
    from taehv_slurm.trainer.speed import use_compile_cache

    imported = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    use_compile_cache(args.cache)
    if args.before:
        import torch._inductor.config as inductor_config

        inductor_config.unsafe_marked_cacheable_functions = {}
    torch.manual_seed(0)
    student = TAEHV(TAEHVConfig()).to(device)
    if cuda:
        student.to(memory_format=torch.channels_last)
        configure_backends(device)  # as a rank does
        if not args.cudnn_benchmark:
            torch.backends.cudnn.benchmark = False
    engine = make_engine("allreduce", DistillModule(student), device, precision="bf16" if cuda else "fp32",
                         grad_clip=1.0, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, compile=True,
                         compile_mode=args.mode, per_gpu_batch=args.batch, grad_accum=args.grad_accum)
    if args.before:
        offset = 0
        for p in (p for p in student.parameters() if p.requires_grad):
            p.grad = engine.flat_grad.as_strided(p.shape, p.stride(), offset)
            offset += p.numel()
    frames = torch.randint(0, 256, (args.batch, args.frames, 3, args.height, args.width), dtype=torch.uint8,
                           device=device)
    latents = torch.randn(args.batch, args.frames // 4, 16, args.height // 8, args.width // 8, device=device)
    step = [Microbatch(frames, latents, 1 / args.grad_accum)] * args.grad_accum
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    built = time.perf_counter()
    marks, times, losses = two_steps(engine, step, sync)
    names, seconds = compile_times(repr="csv", aggregate=True)  # torch's own timers of the compile's phases
    phases = {name: round(float(s), 2) for name, s in zip(names, seconds) if float(s) >= 0.1}
    return {"imports_s": round(imported - START, 2), "build_s": round(built - imported, 2),
            "first_step_s": round(times[0] - built, 2), "second_step_s": round(times[1] - times[0], 2),
            "start_to_first_step_s": round(times[0] - START, 2),
            "aot_autograd": dict(counters["aot_autograd"]), "fxgraph": {
                k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")},
            "compile_phases_s": phases, "first_step_parts_s": first_step_parts(marks, times[0]),
            "losses": losses,  # the same in every start
            # per input shape: loaded, saved (compiled here) or torch.compile (precompile.py)
            "precompiled": list(getattr(engine.forward, "outcomes", {}).values())}


def two_steps(engine: Any, step: list, sync: Callable[[], None]) -> tuple[list[float], ...]:
    """Two training steps: the first's forwards' start and end times (each after the device is idle), both
    steps' end times and losses."""
    marks: list[float] = []
    compiled = engine.forward

    def timed_forward(*inputs: Any) -> Any:
        sync()
        marks.append(time.perf_counter())
        out = compiled(*inputs)
        sync()
        marks.append(time.perf_counter())
        return out

    engine.forward = timed_forward
    first = engine.train_step(step, 1e-4)
    sync()
    times = [time.perf_counter()]
    engine.forward = compiled
    second = engine.train_step(step, 1e-4)
    sync()
    times.append(time.perf_counter())
    return marks, times, [first.means()["loss"], second.means()["loss"]]


def first_step_parts(marks: list[float], end: float) -> dict[str, float]:
    """The first step's timeline from its forwards' start and end times (`marks`, two a micro-batch) and
    the step's end: micro-batch 1's forward and backward, micro-batch 2 whole, the others, then the rest."""
    starts, ends = marks[0::2], marks[1::2]
    parts = {"forward_1": ends[0] - starts[0],
             "backward_1": (starts[1] if len(starts) > 1 else end) - ends[0]}
    if len(starts) > 1:
        parts["microbatch_2"] = (starts[2] if len(starts) > 2 else end) - starts[1]
    if len(starts) > 2:
        parts[f"microbatches_3_to_{len(starts)}_and_update"] = end - starts[2]
    return {k: round(v, 2) for k, v in parts.items()}


def main() -> None:
    from bench._record import add_clip_shape, add_cudnn_benchmark, run_info, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_clip_shape(parser)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=32,
                        help="micro-batches a step (the plan's for the shipped config on one GPU)")
    parser.add_argument("--mode", default="reduce-overhead", help="engine.compile_mode")
    parser.add_argument("--starts", type=int, default=3,
                        help="processes per cache folder: 1 cold, the rest warm")
    parser.add_argument("--ab", action="store_true", help="also the code before (its own cache folder)")
    parser.add_argument("--cache", help=argparse.SUPPRESS)  # a child's cache folder
    parser.add_argument("--before", action="store_true", help=argparse.SUPPRESS)
    add_cudnn_benchmark(parser)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.cache:
        print(json.dumps(one_start(args)))
        return

    import torch

    shape = ["--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width),
             "--batch", str(args.batch), "--grad-accum", str(args.grad_accum), "--mode", args.mode,
             "--cudnn-benchmark" if args.cudnn_benchmark else "--no-cudnn-benchmark"]
    rows = []
    for variant in ("shipped", "before") if args.ab else ("shipped",):
        with tempfile.TemporaryDirectory() as cache:
            for start in range(args.starts):
                flags = ["--before"] if variant == "before" else []
                done = subprocess.run([sys.executable, __file__, "--cache", cache, *shape, *flags],
                                      capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    sys.exit(f"{variant} start {start} failed:\n{done.stderr[-3000:]}")
                row = {"variant": variant, "start": "cold" if start == 0 else "warm",
                       **json.loads(done.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    info = run_info(torch.cuda.is_available(), frames=args.frames, height=args.height, width=args.width,
                    batch=args.batch, grad_accum=args.grad_accum, compile_mode=args.mode,
                    cudnn_benchmark=args.cudnn_benchmark)
    write_results(args.out, "compile_start", {"info": info, "rows": rows})


if __name__ == "__main__":
    main()
