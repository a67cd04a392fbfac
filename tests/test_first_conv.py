"""`first_conv_relu`: the encoder's first conv + bias + ReLU on frame pairs as Triton kernels
(`FAST_PATHS["triton_first_conv"]`, taehv_slurm/trainer/first_conv.py).

The model calls it only on a GPU (half precision, channels-last, an input without gradient); elsewhere the
plain ops run, which tests/test_model.py checks against the published formulation. Here:
- on any machine, the kernels in Triton's CPU interpreter, float32, against the plain ops (output, weight
  and bias gradients), with tiles small enough that programs walk several and the last is partial; the
  tiny model's training pass with them; and the op's FLOP count (MFU);
- on a GPU (marked `gpu`), in bf16: within bf16 rounding of fp32, and the model's training pass runs both
  kernels (a silent fallback would pass every other test) and is as accurate as without them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from taehv_slurm.trainer.first_conv import first_conv_relu
from tests.helpers import REPO, run_interpreted
from tests.test_fused_conv import rel_err, tiny_model_passes

CL = torch.channels_last
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def inputs(dtype: torch.dtype, device: str, n: int = 3, c_in: int = 8, c_out: int = 32, h: int = 9,
           w: int = 13) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.rand(n, c_in, h, w, device=device, dtype=dtype).contiguous(memory_format=CL)
    weight = torch.randn(c_out, c_in, 3, 3, device=device) / (3 * c_in ** 0.5)
    bias = torch.randn(c_out, device=device) / 4  # some outputs negative: the ReLU masks them
    return x, weight.to(dtype), bias.to(dtype)


def check_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 (see module doc)."""
    from unittest import mock

    from taehv_slurm.trainer import first_conv_kernels as kernels
    from taehv_slurm.trainer import layers
    from tests.test_model import tiny_model

    kernels.FORWARD_ROWS = kernels.BACKWARD_ROWS = 16
    kernels.BACKWARD_PROGRAMS = 3
    torch.manual_seed(0)
    for c_in, c_out in ((8, 32), (4, 16)):
        x, weight, bias = inputs(torch.float32, "cpu", c_in=c_in, c_out=c_out)
        leaves = [weight.requires_grad_(), bias.requires_grad_()]
        got, ref = first_conv_relu(x, *leaves), F.relu(F.conv2d(x, *leaves, padding=1))
        assert got.is_contiguous(memory_format=CL) and got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(ref)
        for name, a, r in zip(("weight", "bias"), torch.autograd.grad(got, leaves, grad),
                              torch.autograd.grad(ref, leaves, grad)):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    model = tiny_model().to(memory_format=CL)
    clip = torch.rand(1, 4, 3, 16, 32)
    results = []
    for on in (True, False):
        model.zero_grad()
        with mock.patch.object(layers, "first_conv_runs", lambda x, w, on=on: on and not x.requires_grad):
            z, out = model(clip)
        (out.square().sum() + z.sum()).backward()
        results.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
    errors = [rel_err(a, b) for a, b in zip(*results)]
    assert max(errors) < 1e-5, errors
    print("interpreted first conv matches")


def test_the_kernels_compute_the_plain_ops() -> None:
    run_interpreted("from tests.test_first_conv import check_interpreted; check_interpreted()",
                    "interpreted first conv matches")


def test_the_op_counts_the_convolutions_flops() -> None:
    x, weight, bias = inputs(torch.float32, "meta")
    counts = []
    for op in (first_conv_relu, lambda *a: F.conv2d(*a, padding=1)):
        with FlopCounterMode(display=False) as counter:
            op(x, weight, bias)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


@pytest.mark.gpu
@needs_gpu
def test_the_kernels_are_within_bf16_rounding_of_fp32() -> None:
    torch.manual_seed(0)
    x, weight, bias = inputs(torch.bfloat16, "cuda", n=4, c_out=128, h=96, w=160)
    leaves = [weight.requires_grad_(), bias.requires_grad_()]
    fp32 = [t.detach().float().requires_grad_() for t in leaves]
    got, ref = first_conv_relu(x, *leaves), F.relu(F.conv2d(x.float(), *fp32, padding=1))
    assert got.dtype == torch.bfloat16 and got.is_contiguous(memory_format=CL) and rel_err(got, ref) < 1e-2
    grad = torch.randn_like(ref)
    for name, a, r in zip(("weight", "bias"), torch.autograd.grad(got, leaves, grad.bfloat16()),
                          torch.autograd.grad(ref, fp32, grad)):
        assert rel_err(a, r) < 1e-2, name


@pytest.mark.gpu
@needs_gpu
def test_training_runs_the_first_conv_as_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's bf16 channels-last pass runs both kernels, and with them the latents, frames and
    every gradient are as close to an fp32 run as the plain path's."""
    run = tiny_model_passes(monkeypatch, "triton_first_conv")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours = run(True, torch.bfloat16)
        torch.cuda.synchronize()
    kernels = {e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert {"_first_conv_forward", "_first_conv_backward"} <= kernels, sorted(kernels)
    ref, before = run(False, torch.float32), run(False, torch.bfloat16)
    for o, r, b in zip(ours, ref, before):
        assert rel_err(o, r) <= max(1.5 * rel_err(b, r), 1e-2), (rel_err(o, r), rel_err(b, r))


def test_the_environment_turns_fast_paths_off_by_name() -> None:
    """TAEHV_FAST_PATHS_OFF (the benchmarks' A/B through the user's command) turns the named paths off in
    every process that imports the model; an unknown name stops the import with one line naming the known."""
    show = ("from taehv_slurm.trainer.layers import FAST_PATHS; "
            "print(sorted(k for k, v in FAST_PATHS.items() if not v))")
    runs = {off: subprocess.run([sys.executable, "-c", show], cwd=REPO, capture_output=True, text=True,
                                env={**os.environ, "TAEHV_FAST_PATHS_OFF": off}, timeout=120)
            for off in ("copy_overlap,triton_first_conv", "copy_overlap,bogus")}
    good, bad = runs.values()
    assert good.returncode == 0 and good.stdout.strip() == str(sorted(["copy_overlap", "split_memblock",
                                                                        "triton_first_conv"])), good.stderr
    assert bad.returncode != 0 and "TAEHV_FAST_PATHS_OFF names bogus: use names of" in bad.stderr
