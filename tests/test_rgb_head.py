"""`relu_conv3x3_frames`: the decoder's ReLU + RGB head as Triton kernels on the stacked frames
(`FAST_PATHS["triton_head"]`, taehv_slurm/trainer/rgb_head.py).

The model calls it only on a GPU (half precision, channels-last); elsewhere it runs the plain ops, which
tests/test_model.py checks against the published formulation. Here:
- on any machine, the kernels themselves, run by Triton's interpreter on CPU in float32 against the plain
  ops, at a shape that splits rows, columns and channels into several blocks (the interpreter is installed
  apart from the suite's packages by scripts/setup.sh: a CPU machine has no Triton, and importing it would
  slow every process); and the op's FLOP count (MFU);
- on a GPU (marked `gpu`), in bf16 as training runs: values and gradients within bf16 rounding of fp32, and
  the model's training pass runs the kernels (a silent fallback would still pass every other test).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from taehv_slurm.trainer.layers import _unstack_frames
from taehv_slurm.trainer.rgb_head import relu_conv3x3_frames
from tests.helpers import run_interpreted
from tests.test_fused_conv import rel_err, tiny_model_passes

CL = torch.channels_last
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def plain(stacked: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, frames: int) -> torch.Tensor:
    return F.conv2d(F.relu(_unstack_frames(stacked, frames)), weight, bias, padding=1)


def inputs(dtype: torch.dtype, device: str, n: int = 1, frames: int = 2, c: int = 32, h: int = 11,
           w: int = 40, out: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    stacked = torch.randn(n, frames * c, h, w, device=device, dtype=dtype).contiguous(memory_format=CL)
    weight = torch.randn(out, c, 3, 3, device=device) / (3 * c ** 0.5)
    bias = torch.randn(out, device=device)
    return stacked, weight, bias


def check_interpreted() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: the kernels' values and gradients against the plain ops,
    float32 on CPU, with blocks small enough that rows, columns and channels each span several; then the
    model's training pass with them."""
    from taehv_slurm.trainer import rgb_head_kernels as kernels

    kernels.FORWARD_ROWS, kernels.FORWARD_COLS, kernels.BACKWARD_COLS = 8, 32, 32
    kernels.FORWARD_CHANNELS = kernels.BACKWARD_CHANNELS = 16
    stacked, weight, bias = inputs(torch.float32, "cpu")
    leaves = [t.requires_grad_() for t in (stacked, weight, bias)]
    got, ref = relu_conv3x3_frames(*leaves, 2), plain(*leaves, 2)
    assert got.shape == ref.shape == (2, 12, 11, 40)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(ref)
    for name, a, r in zip(("stacked", "weight", "bias"), torch.autograd.grad(got, leaves, grad),
                          torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    check_interpreted_model()
    print("interpreted kernels match")


def check_interpreted_model() -> None:
    """The tiny model with its head on the kernels (forced: the model picks them only on a GPU) against the
    plain path, float32: output and every parameter's gradient."""
    from unittest import mock

    from taehv_slurm.trainer import layers
    from tests.test_model import tiny_model

    model = tiny_model().to(memory_format=CL)
    x = torch.rand(1, 4, 3, 16, 32)
    results = []
    for on in (True, False):
        model.zero_grad()
        with mock.patch.object(layers, "triton_head_runs", lambda stacked, weight, on=on: on):
            z, out = model(x)
        (out.square().sum() + z.sum()).backward()
        results.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
    errors = [rel_err(a, b) for a, b in zip(*results)]
    assert max(errors) < 1e-5, errors


def test_the_kernels_compute_the_plain_ops() -> None:
    run_interpreted("from tests.test_rgb_head import check_interpreted; check_interpreted()",
                    "interpreted kernels match")


def test_the_op_counts_the_convolutions_flops() -> None:
    """Forward: the head conv's FLOPs on every frame; backward: twice that (input and weight gradients)."""
    with FakeTensorMode():
        stacked, weight, bias = inputs(torch.float32, "cpu")
        leaves = [t.requires_grad_() for t in (stacked, weight, bias)]
        counts = []
        for op in (relu_conv3x3_frames, plain):
            with FlopCounterMode(display=False) as counter:
                out = op(*leaves, 2)
                torch.autograd.grad(out, leaves[:2], torch.ones_like(out))
            counts.append(counter.get_flop_counts()["Global"])
    ours, theirs = counts
    forward = sum(n for op, n in theirs.items() if "backward" not in str(op))
    assert forward > 0 and ours[torch.ops.taehv.relu_conv3x3_frames] == forward
    assert ours[torch.ops.taehv.relu_conv3x3_frames_backward] == 2 * forward == theirs[
        torch.ops.aten.convolution_backward]


@pytest.mark.gpu
@needs_gpu
def test_the_kernels_are_within_bf16_rounding_of_fp32() -> None:
    stacked, weight, bias = inputs(torch.bfloat16, "cuda", n=3, c=256, h=70, w=150)
    leaves = [t.requires_grad_() for t in (stacked, weight, bias)]
    fp32 = [t.detach().float().requires_grad_() for t in leaves]
    got, ref = relu_conv3x3_frames(*leaves, 2), plain(*fp32, 2)
    assert got.dtype == torch.bfloat16 and rel_err(got, ref) < 1e-2
    grad = torch.randn_like(ref)
    for name, a, r in zip("swb", torch.autograd.grad(got, leaves, grad.bfloat16()),
                          torch.autograd.grad(ref, fp32, grad)):
        assert rel_err(a, r) < 1e-2, name


@pytest.mark.gpu
@needs_gpu
def test_training_runs_the_head_as_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's bf16 channels-last pass calls both kernels, and with them its output and head
    gradients are as close to an fp32 run as the plain path's."""
    passes = tiny_model_passes(monkeypatch, "triton_head")

    def run(on: bool, dtype: torch.dtype) -> list[torch.Tensor]:
        _, out, *grads = passes(on, dtype)
        return [out, *grads[-2:]]  # the frames, the head's weight and bias

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours = run(True, torch.bfloat16)
        torch.cuda.synchronize()
    kernels = {e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert {"_forward", "_backward"} <= kernels, sorted(kernels)
    ref, before = run(False, torch.float32), run(False, torch.bfloat16)
    for o, r, b in zip(ours, ref, before):
        assert rel_err(o, r) <= max(1.5 * rel_err(b, r), 1e-2), (rel_err(o, r), rel_err(b, r))
