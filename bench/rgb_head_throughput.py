"""The decoder's ReLU + RGB head, isolated: the Triton kernels (`FAST_PATHS["triton_head"]`) against the
plain path (copy the stacked frames into frames, ReLU, cuDNN conv), forward and forward + backward, at the
shape the shipped config trains on.

    python bench/rgb_head_throughput.py            # GPU: ms per call of each path, the kernels' accuracy
    python bench/rgb_head_throughput.py --sweep    # ... and the kernels' block sizes (how the defaults came)
    python bench/rgb_head_throughput.py --smoke    # CPU, tiny shapes, plain path only: checks the script runs

A micro-benchmark: what the kernels save in a training step is measured by bench/train_throughput.py
(``--fast`` with and without triton_head), and through the user's command by bench/e2e_throughput.py.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._record import kernel_bench_args, run_info, write_results  # noqa: E402
from taehv_slurm.trainer import model as model_module  # noqa: E402
from taehv_slurm.trainer.layers import _unstack_frames, rgb_conv  # noqa: E402
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig  # noqa: E402
from taehv_slurm.trainer.rgb_head import relu_conv3x3_frames  # noqa: E402

CL = torch.channels_last


def head_shapes(batch: int, frames: int, height: int, width: int) -> tuple[list[int], int, int, int]:
    """The stacked tensor's shape, its frames per image, and the head's input and output channels on the
    phase layout, as the model's training pass calls the head (run on fake tensors: no compute)."""
    seen = []
    phase_head = model_module.phase_head

    def record(stacked: torch.Tensor, k: int, head: torch.nn.Conv2d, up: int) -> torch.Tensor:
        seen.append((list(stacked.shape), k, head.in_channels * up * up, head.out_channels * up * up))
        return phase_head(stacked, k, head, up)

    with FakeTensorMode(), mock.patch.object(model_module, "phase_head", record):
        TAEHV(TAEHVConfig())(torch.empty(batch, frames, 3, height, width))
    return seen[0]


def plain(stacked: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, frames: int) -> torch.Tensor:
    return rgb_conv(F.relu(_unstack_frames(stacked, frames)), weight, bias)


def ms_per_call(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    import time

    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1000 / iters


def paths(on_gpu: bool) -> dict:
    """The paths to time: on CPU (--smoke) only the eager one (compiling it costs the smoke run 8 s)."""
    if not on_gpu:
        return {"plain_eager": plain}
    return {"plain_eager": plain, "plain_compiled": torch.compile(plain), "triton": relu_conv3x3_frames}


def timings(stacked: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, on_gpu: bool,
            iters: int) -> list[dict]:
    leaves = [t.requires_grad_() for t in (stacked, weight, bias)]
    rows = []
    for name, fn in paths(on_gpu).items():
        grad = torch.randn_like(fn(*leaves, k))
        rows.append({"path": name,
                     "forward_ms": ms_per_call(lambda fn=fn: fn(*leaves, k), iters),
                     "forward_backward_ms": ms_per_call(
                         lambda fn=fn, grad=grad: torch.autograd.grad(fn(*leaves, k), leaves, grad), iters)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def accuracy(k: int, c: int, cout: int) -> dict:
    """Relative error of the kernels in bf16 and of the plain path in bf16, each against fp32."""
    torch.manual_seed(0)
    stacked = torch.randn(4, k * c, 60, 90, device="cuda").contiguous(memory_format=CL)
    weight = torch.randn(cout, c, 3, 3, device="cuda") / (3 * c ** 0.5)
    bias = torch.randn(cout, device="cuda")
    ref = plain(stacked, weight, bias, k)
    half = stacked.bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = {"triton": relu_conv3x3_frames(half, weight, bias, k),
               "plain_bf16": plain(half, weight, bias, k)}
    return {name: float((v.float() - ref).norm() / ref.norm()) for name, v in got.items()}


def sweep(stacked: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int) -> list[dict]:
    from taehv_slurm.trainer import rgb_head_kernels as kernels

    grad = torch.randn_like(kernels.forward(stacked, weight, bias, k))
    rows, saved = [], {name: getattr(kernels, name) for name in dir(kernels) if name.isupper()}
    for cols, channels, warps, stages in itertools.product([64, 128], [32, 64], [4, 8], [1, 2, 3]):
        kernels.FORWARD_COLS, kernels.FORWARD_CHANNELS = cols, channels
        kernels.FORWARD_WARPS, kernels.FORWARD_STAGES = warps, stages
        rows.append(sweep_row("forward", lambda: kernels.forward(stacked, weight, bias, k),
                              cols=cols, channels=channels, warps=warps, stages=stages))
    for cols, channels, warps in itertools.product([32, 64, 128], [64, 128], [4, 8]):
        kernels.BACKWARD_COLS, kernels.BACKWARD_CHANNELS, kernels.BACKWARD_WARPS = cols, channels, warps
        rows.append(sweep_row("backward", lambda: kernels.backward(grad, stacked, weight, k),
                              cols=cols, channels=channels, warps=warps))
    for name, value in saved.items():
        setattr(kernels, name, value)
    return rows


def sweep_row(kernel: str, fn, **blocks: int) -> dict:
    try:
        row = {"kernel": kernel, **blocks, "ms": ms_per_call(fn, 5)}
    except Exception as e:  # a block size over the GPU's shared memory is a row, not a failure
        row = {"kernel": kernel, **blocks, "error": f"{type(e).__name__}: {str(e)[:80]}"}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    args = kernel_bench_args(__doc__, iters=10,
                             what_sweeps="the kernels' block sizes", smoke_path="the plain path")
    on_gpu = args.on_gpu
    shape, k, c, cout = head_shapes(args.batch, args.frames, args.height, args.width)
    info = run_info(on_gpu, clip=[args.frames, args.height, args.width], batch=args.batch,
                    stacked_shape=shape, frames_per_image=k)
    print(json.dumps(info), flush=True)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    if on_gpu:
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    stacked = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=CL)
    weight = torch.randn(cout, c, 3, 3, device=device) / (3 * c ** 0.5)
    bias = torch.randn(cout, device=device)
    result = {"info": info, "rows": timings(stacked, weight, bias, k, on_gpu, args.iters)}
    if on_gpu:
        result["rel_err_vs_fp32"] = accuracy(k, c, cout)
        print(json.dumps(result["rel_err_vs_fp32"]), flush=True)
        if args.sweep:
            result["sweep"] = sweep(stacked.detach(), weight.detach(), bias.detach(), k)
    write_results(args.out, "rgb_head_throughput_smoke" if args.smoke else "rgb_head_throughput", result)


if __name__ == "__main__":
    main()
