"""`conv3x3_relu`: conv + bias (+ residual) + ReLU as one cuDNN kernel (`FAST_PATHS["fused_conv_relu"]`).

The model uses it only where cuDNN fuses it (half precision, channels-last, CUDA); elsewhere it runs the
plain ops, which tests/test_model.py checks against the published formulation. Here, on any machine: its
backward is the gradient of its forward (float64, numerically) and it counts the FLOPs of the convolution
it runs (MFU). On a GPU (marked `gpu`; `python -m pytest -m gpu -n 0 -q`), in bf16 and channels-last as
training runs: it is ONE kernel (a silent fallback to conv + elementwise kernels once cost 8 clips/s on an
H200 while every CPU test passed), within bf16 rounding of fp32, and the whole model with it is as accurate
as without it. Its backward's ReLU mask + bias gradient as one Triton kernel
(`FAST_PATHS["triton_relu_grad"]`): in Triton's CPU interpreter against the aten ops on any machine; on a
GPU, that training runs it once per fused conv.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from taehv_slurm.trainer.layers import FAST_PATHS, conv3x3_relu
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig, init_for_training
from tests.helpers import run_interpreted

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def full_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 references in fp32, not TF32 (cuDNN's default for fp32 convolutions)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("with_residual", [False, True], ids=["conv-relu", "conv-add-relu"])
def test_the_backward_is_the_forwards_gradient_and_flops_are_the_convs(with_residual: bool) -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 4, 5, 6), torch.randn(3, 4, 3, 3) / 6, torch.randn(3) / 10
    z = torch.randn(2, 3, 5, 6) if with_residual else None
    inputs = tuple(t.double().requires_grad_() for t in (x, w, b, z) if t is not None)
    assert torch.autograd.gradcheck(conv3x3_relu, inputs)
    counts = []
    for op in (lambda: conv3x3_relu(*inputs), lambda: F.conv2d(*inputs[:3], padding=1)):
        with FlopCounterMode(display=False) as counter:
            op()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


CL = torch.channels_last


def check_interpreted() -> None:
    """Run with TRITON_INTERPRET=1: the backward's ReLU + bias-gradient kernel against threshold_backward
    and a sum, float32 on CPU, with tiles small enough that there are many and the last is partial, exact
    zeros and a NaN in the ReLU's output; then `conv3x3_relu`'s gradients with the kernel (forced: the model
    picks it only on a GPU) against without it."""
    from unittest import mock

    from taehv_slurm.trainer import layers
    from taehv_slurm.trainer import relu_grad_kernel as kernel

    kernel.TILE = 64
    torch.manual_seed(0)
    for c in (16, 64):
        out = F.relu(torch.randn(2, c, 7, 9)).contiguous(memory_format=CL)
        out[0, :, 0, 0] = float("nan")  # threshold_backward passes the gradient where out is NaN
        grad = torch.randn_like(out)
        masked, bias_grad = kernel.relu_bias_grad(grad, out)
        ref = torch.ops.aten.threshold_backward(grad, out, 0)
        assert masked.is_contiguous(memory_format=CL) and torch.equal(masked, ref)
        torch.testing.assert_close(bias_grad, ref.sum((0, 2, 3)))
    x, w = torch.randn(2, 16, 7, 9).contiguous(memory_format=CL), torch.randn(32, 16, 3, 3) / 12
    b, z = torch.randn(32) / 10, torch.randn(2, 32, 7, 9).contiguous(memory_format=CL)
    leaves = [t.requires_grad_() for t in (x, w.contiguous(memory_format=CL), b, z)]
    grad_out, grads = torch.randn(2, 32, 7, 9).contiguous(memory_format=CL), []
    for on in (True, False):
        with mock.patch.object(layers, "_triton_relu_grad_runs", lambda grad, out, on=on: on):
            grads.append(torch.autograd.grad(conv3x3_relu(*leaves), leaves, grad_out))
    for name, a, r in zip("xwbz", *grads):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    print("interpreted kernel matches")


def test_the_backward_kernel_computes_the_relu_and_bias_gradients() -> None:
    run_interpreted("from tests.test_fused_conv import check_interpreted; check_interpreted()",
                    "interpreted kernel matches")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().float() - ref.detach().float()).norm() / ref.detach().float().norm())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("with_residual", [False, True], ids=["conv-relu", "conv-add-relu"])
def test_the_fused_conv_runs_as_one_cudnn_kernel_with_fp32_accuracy(with_residual: bool) -> None:
    """Values and gradients within bf16 rounding of the same sum in fp32, from the same inputs (the
    fused kernel rounds once, so its ReLU mask is the fp32 one)."""
    torch.manual_seed(0)
    x = torch.randn(4, 64, 60, 90, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = (torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16) / 24).contiguous(memory_format=CL)
    b = torch.randn(64, device="cuda", dtype=torch.bfloat16) / 10
    z = torch.randn_like(x) if with_residual else None
    inputs = [t.requires_grad_() for t in (x, w, b, z) if t is not None]
    fp32 = [t.detach().float().requires_grad_() for t in inputs]
    ref = F.relu(F.conv2d(fp32[0], fp32[1], fp32[2], padding=1) + (fp32[3] if with_residual else 0))
    got = conv3x3_relu(x, w, b, z)
    assert got.dtype == torch.bfloat16 and got.is_contiguous(memory_format=CL)
    assert rel_err(got, ref) < 1e-2
    g = torch.randn_like(got)
    grads = zip("xwbz", torch.autograd.grad(got, inputs, g), torch.autograd.grad(ref, fp32, g.float()))
    for name, a, r in grads:
        assert rel_err(a, r) < 1e-2, name
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        conv3x3_relu(x, w, b, z)
        torch.cuda.synchronize()
    kernels = [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.key.startswith("Memset")]
    assert len(kernels) == 1 and "fprop" in kernels[0], kernels


def tiny_model_passes(monkeypatch: pytest.MonkeyPatch,
                      fast_path: str) -> Callable[[bool, torch.dtype], list[torch.Tensor]]:
    """A tiny model on the GPU, channels-last as training runs, and ``run(on, dtype)``: one training pass
    with ``FAST_PATHS[fast_path]`` set to ``on``, in ``dtype`` autocast (none for fp32) → latents, decoded
    frames, then every parameter's gradient (the head's weight and bias last)."""
    torch.manual_seed(0)
    model = TAEHV(TAEHVConfig(encoder_width=32, decoder_widths=(64, 32, 32, 32)))
    init_for_training(model)
    model = model.cuda().to(memory_format=CL)
    x = torch.rand(2, 8, 3, 64, 96, device="cuda")

    def run(on: bool, dtype: torch.dtype) -> list[torch.Tensor]:
        monkeypatch.setitem(FAST_PATHS, fast_path, on)
        model.zero_grad()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            z, out = model(x)
        (out.float().square().mean() + z.float().square().mean()).backward()
        return [z, out] + [p.grad.clone() for p in model.parameters()]

    return run


@pytest.mark.gpu
@needs_gpu
def test_the_fused_model_is_as_accurate_as_the_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole training pass in bf16 autocast, fused and plain, each against the plain pass in fp32:
    latents, decoded frames and every parameter's gradient."""
    run = tiny_model_passes(monkeypatch, "fused_conv_relu")
    ref, plain, fused = run(False, torch.float32), run(False, torch.bfloat16), run(True, torch.bfloat16)
    for r, p, f in zip(ref, plain, fused):
        assert rel_err(f, r) <= max(1.5 * rel_err(p, r), 1e-2), (rel_err(f, r), rel_err(p, r))


@pytest.mark.gpu
@needs_gpu
def test_training_runs_each_relu_backward_as_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's bf16 channels-last pass runs the ReLU + bias-gradient kernel once for each fused
    conv (a silent fallback would pass every other test), and with it the latents, frames and every
    gradient are as close to an fp32 run as without it."""
    run = tiny_model_passes(monkeypatch, "triton_relu_grad")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ours = run(True, torch.bfloat16)
        torch.cuda.synchronize()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("_relu_bias_grad", 0) == counts["taehv::conv3x3_relu"] > 0, counts
    ref, before = run(False, torch.float32), run(False, torch.bfloat16)
    for o, r, b in zip(ours, ref, before):
        assert rel_err(o, r) <= max(1.5 * rel_err(b, r), 1e-2), (rel_err(o, r), rel_err(b, r))
