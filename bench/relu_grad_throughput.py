"""The fused conv's backward ReLU + bias gradient, isolated: the Triton kernel
(`FAST_PATHS["triton_relu_grad"]`) against what the compiler makes of the same sum (threshold_backward,
then a reduction), at each shape the shipped config's training pass runs it on.

    python bench/relu_grad_throughput.py            # GPU: µs per call of each path, bias-gradient errors
    python bench/relu_grad_throughput.py --sweep    # ... and its tile and warps (how the defaults came)
    python bench/relu_grad_throughput.py --smoke    # CPU, tiny shapes, eager only: checks the script runs

A micro-benchmark: what the kernel saves in a training step is measured by bench/train_throughput.py
(``--fast`` with and without triton_relu_grad, each with its own TORCHINDUCTOR_CACHE_DIR: torch's caches key a
compiled graph by the custom op's name, not by the backward traced from it), and through the user's command
by bench/e2e_throughput.py.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._record import kernel_bench_args, run_info, write_results  # noqa: E402
from bench.rgb_head_throughput import ms_per_call  # noqa: E402
from taehv_slurm.trainer import layers  # noqa: E402
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig  # noqa: E402

CL = torch.channels_last


def fused_conv_shapes(batch: int, frames: int, height: int, width: int) -> Counter:
    """The output shapes of the fused convs in the model's training pass, with how often each runs (on fake
    tensors: no compute; the fused path forced, as a GPU takes it)."""
    seen: Counter = Counter()

    def record(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        out = layers._plain_conv3x3_relu(x, weight, bias, residual)
        seen[tuple(out.shape)] += 1
        return out

    with FakeTensorMode(), mock.patch.object(layers, "_cudnn_fuses", lambda x: True), \
            mock.patch.object(layers, "conv3x3_relu", record):
        TAEHV(TAEHVConfig())(torch.empty(batch, frames, 3, height, width))
    return seen


def threshold_and_sum(grad: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    masked = torch.ops.aten.threshold_backward(grad, out, 0)
    return masked, masked.sum((0, 2, 3), dtype=torch.float32).to(out.dtype)


def paths(on_gpu: bool) -> dict:
    if not on_gpu:
        return {"eager": threshold_and_sum}
    from taehv_slurm.trainer import relu_grad_kernel

    return {"eager": threshold_and_sum, "compiled": torch.compile(threshold_and_sum),
            "triton": relu_grad_kernel.relu_bias_grad}


def inputs(shape: tuple, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.relu(torch.randn(shape, device=device, dtype=dtype)).contiguous(memory_format=CL)
    return torch.randn_like(out), out


def timings(shapes: Counter, on_gpu: bool, iters: int) -> list[dict]:
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    rows = []
    for shape, calls in shapes.items():
        grad, out = inputs(shape, device, dtype)
        reference = grad.float().where(out.float() > 0, 0).sum((0, 2, 3))
        for name, fn in paths(on_gpu).items():
            sums = fn(grad, out)[1].float()
            rows.append({"shape": list(shape), "calls_per_step": calls, "path": name,
                         "us": 1000 * ms_per_call(lambda fn=fn, g=grad, o=out: fn(g, o), iters),
                         "bias_grad_rel_err": float((sums - reference).norm() / reference.norm())})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep(shapes: Counter) -> list[dict]:
    """Each tile and warp count, timed over one step's calls (each shape × how often it runs)."""
    from taehv_slurm.trainer import relu_grad_kernel as kernel

    data = [(inputs(shape, "cuda", torch.bfloat16), calls) for shape, calls in shapes.items()]
    rows, saved = [], (kernel.TILE, kernel.WARPS)
    for kernel.TILE, kernel.WARPS in itertools.product([4096, 8192, 16384, 32768], [4, 8]):
        step_us = sum(calls * 1000 * ms_per_call(lambda g=g, o=o: kernel.relu_bias_grad(g, o), 20)
                      for (g, o), calls in data)
        rows.append({"tile": kernel.TILE, "warps": kernel.WARPS, "us_per_step": step_us})
        print(json.dumps(rows[-1]), flush=True)
    kernel.TILE, kernel.WARPS = saved
    return rows


def main() -> None:
    args = kernel_bench_args(__doc__, iters=20,
                             what_sweeps="the kernel's tile and warps", smoke_path="the eager path")
    on_gpu = args.on_gpu
    shapes = fused_conv_shapes(args.batch, args.frames, args.height, args.width)
    info = run_info(on_gpu, clip=[args.frames, args.height, args.width], batch=args.batch,
                    fused_conv_calls_per_step=sum(shapes.values()))
    print(json.dumps(info), flush=True)
    result = {"info": info, "rows": timings(shapes, on_gpu, args.iters)}
    if on_gpu and args.sweep:
        result["sweep"] = sweep(shapes)
    write_results(args.out, "relu_grad_throughput_smoke" if args.smoke else "relu_grad_throughput", result)


if __name__ == "__main__":
    main()
