"""The encoder's first conv + ReLU, isolated: the Triton kernels (`FAST_PATHS["triton_first_conv"]`) against
the path they replace (cuDNN's fused conv + bias + ReLU forward; backward the ReLU + bias-gradient kernel,
then cuDNN's weight gradient), at the shipped config's shape (a micro-batch's frame pairs, 8 → 128
channels at 480×720).

    python bench/first_conv_throughput.py            # GPU: ms per call of each path, errors against fp32
    python bench/first_conv_throughput.py --sweep    # ... and the kernels' rows and warps (the defaults)
    python bench/first_conv_throughput.py --smoke    # CPU, tiny shape: checks the script runs (no kernels)

A micro-benchmark: what the kernels save in a training step is measured by bench/train_throughput.py
(``--fast`` with and without triton_first_conv), and through the user's command by bench/e2e_throughput.py.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._record import kernel_bench_args, run_info, write_results  # noqa: E402
from bench.rgb_head_throughput import ms_per_call  # noqa: E402

CL = torch.channels_last


def inputs(pairs: int, height: int, width: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Frame pairs (6 channels padded to 8, channels-last), the block-diagonal pair weight, bias, and an
    output gradient."""
    x = F.pad(torch.rand(pairs, 6, height, width, device=device), (0, 0, 0, 0, 0, 2))
    single = torch.randn(64, 3, 3, 3, device=device) / 5
    weight = torch.zeros(128, 8, 3, 3, device=device)
    weight[:64, :3], weight[64:, 3:6] = single, single
    bias = torch.randn(128, device=device) / 4
    grad = torch.randn(pairs, 128, height, width, device=device)
    return (x.to(dtype).contiguous(memory_format=CL), weight.to(dtype).contiguous(memory_format=CL),
            bias.to(dtype), grad.to(dtype).contiguous(memory_format=CL))


def cudnn_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.cudnn_convolution_relu(x, weight, bias, [1, 1], [1, 1], [1, 1], 1)


def cudnn_backward(grad: torch.Tensor, out: torch.Tensor, x: torch.Tensor,
                   weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from taehv_slurm.trainer.relu_grad_kernel import relu_bias_grad

    masked, db = relu_bias_grad(grad, out)
    _, dw, _ = torch.ops.aten.convolution_backward(masked, x, weight, [weight.shape[0]], [1, 1], [1, 1],
                                                   [1, 1], False, [0, 0], 1, [False, True, False])
    return dw, db


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def timings(args) -> list[dict]:
    from taehv_slurm.trainer import first_conv_kernels as kernels

    x, weight, bias, grad = inputs(args.batch * args.frames // 2, args.height, args.width, "cuda",
                                   torch.bfloat16)
    with torch.no_grad():
        xf, wf = x.float(), weight.float()
        ref = F.relu(F.conv2d(xf, wf, bias.float(), padding=1))
        masked = grad.float().where(ref > 0, 0)
        ref_dw = torch.ops.aten.convolution_backward(masked, xf, wf, [128], [1, 1], [1, 1], [1, 1], False,
                                                     [0, 0], 1, [False, True, False])[1]
        ref_db = masked.sum((0, 2, 3))
    rows = []
    for name, fwd, bwd in (("cudnn", cudnn_forward, lambda g, o: cudnn_backward(g, o, x, weight)),
                           ("triton", kernels.forward, lambda g, o: kernels.backward(g, o, x))):
        out = fwd(x, weight, bias)
        dw, db = bwd(grad, out)
        rows.append({"path": name, "forward_ms": ms_per_call(lambda f=fwd: f(x, weight, bias), args.iters),
                     "backward_ms": ms_per_call(lambda b=bwd, o=out: b(grad, o), args.iters),
                     "out_rel_err": rel_err(out, ref), "weight_grad_rel_err": rel_err(dw, ref_dw),
                     "bias_grad_rel_err": rel_err(db, ref_db)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep(args) -> list[dict]:
    """The kernels' rows per tile and warps (and the backward's programs), each timed alone."""
    from taehv_slurm.trainer import first_conv_kernels as k

    x, weight, bias, grad = inputs(args.batch * args.frames // 2, args.height, args.width, "cuda",
                                   torch.bfloat16)
    out = k.forward(x, weight, bias)
    saved = (k.FORWARD_ROWS, k.FORWARD_WARPS, k.BACKWARD_ROWS, k.BACKWARD_WARPS, k.BACKWARD_PROGRAMS)
    rows = []
    for k.FORWARD_ROWS, k.FORWARD_WARPS in itertools.product([64, 128, 256], [4, 8]):
        rows.append({"kernel": "forward", "rows": k.FORWARD_ROWS, "warps": k.FORWARD_WARPS,
                     "ms": ms_per_call(lambda: k.forward(x, weight, bias), args.iters)})
        print(json.dumps(rows[-1]), flush=True)
    for k.BACKWARD_ROWS, k.BACKWARD_WARPS, k.BACKWARD_PROGRAMS in [(64, 4, 528), (128, 4, 528), (128, 8, 528),
                                                                  (128, 8, 264), (128, 8, 1056)]:
        rows.append({"kernel": "backward", "rows": k.BACKWARD_ROWS, "warps": k.BACKWARD_WARPS,
                     "programs": k.BACKWARD_PROGRAMS, "ms": ms_per_call(lambda: k.backward(grad, out, x),
                                                                        args.iters)})
        print(json.dumps(rows[-1]), flush=True)
    (k.FORWARD_ROWS, k.FORWARD_WARPS, k.BACKWARD_ROWS, k.BACKWARD_WARPS, k.BACKWARD_PROGRAMS) = saved
    return rows


def main() -> None:
    args = kernel_bench_args(__doc__, iters=20, what_sweeps="the kernels' rows, warps and programs",
                             smoke_path="the inputs and fp32 reference")
    info = run_info(args.on_gpu, clip=[args.frames, args.height, args.width], batch=args.batch)
    print(json.dumps(info), flush=True)
    if not args.on_gpu:  # the kernels need a GPU (tests/test_first_conv.py runs them interpreted)
        x, weight, bias, _ = inputs(args.batch * args.frames // 2, args.height, args.width, "cpu",
                                    torch.float32)
        result = {"info": info, "rows": [{"path": "reference", "out_mean": float(
            F.relu(F.conv2d(x, weight, bias, padding=1)).mean())}]}
    else:
        result = {"info": info, "rows": timings(args)}
        if args.sweep:
            result["sweep"] = sweep(args)
    write_results(args.out, "first_conv_throughput_smoke" if args.smoke else "first_conv_throughput", result)


if __name__ == "__main__":
    main()
