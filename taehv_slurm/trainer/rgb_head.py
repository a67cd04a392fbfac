"""The decoder's ReLU + RGB head on the last stage's stacked phases as one op (`FAST_PATHS["triton_head"]`).

The last stage's conv leaves K new frames × C phase channels stacked on the channels. The plain path copies
them into frames, applies the ReLU, and runs the head's 3×3 conv, whose few outputs (12) fill a quarter of
cuDNN's tiles. `relu_conv3x3_frames` does all three in Triton kernels (`rgb_head_kernels.py`) that read the
stacked tensor in place: forward, one read of it; backward, one read and one write of its gradient.
"""

from __future__ import annotations

import importlib.util

import torch
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

HAS_TRITON = importlib.util.find_spec("triton") is not None  # comes with torch's CUDA builds
MAX_OUTPUTS = 16


def triton_head_runs(stacked: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where the kernels run: CUDA, half precision, channels-last (training's layout), up to 16 outputs
    and input channels in blocks of 16."""
    return (HAS_TRITON and stacked.is_cuda and stacked.dtype in (torch.float16, torch.bfloat16)
            and stacked.is_contiguous(memory_format=torch.channels_last)
            and weight.shape[0] <= MAX_OUTPUTS and weight.shape[1] % 16 == 0)


@torch.library.custom_op("taehv::relu_conv3x3_frames", mutates_args=())
def relu_conv3x3_frames(stacked: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        frames: int) -> torch.Tensor:
    """conv3x3(relu(frame), weight, bias, padding=1) for each of the ``frames`` frames stacked on the
    channels of (N, frames·C, H, W): (N·frames, out, H, W), frame n·frames + k from channel block k of
    image n. ``weight`` (out, C, 3, 3) and ``bias`` are fp32 (the composed head); the result has the
    input's dtype."""
    from taehv_slurm.trainer import rgb_head_kernels

    return rgb_head_kernels.forward(stacked, weight, bias, frames)


@relu_conv3x3_frames.register_fake
def _(stacked: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, frames: int) -> torch.Tensor:
    n, _, h, w = stacked.shape
    return stacked.new_empty(n * frames, weight.shape[0], h, w)


@torch.library.custom_op("taehv::relu_conv3x3_frames_backward", mutates_args=())
def relu_conv3x3_frames_backward(grad: torch.Tensor, stacked: torch.Tensor, weight: torch.Tensor,
                                 frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `relu_conv3x3_frames` for ``stacked`` (its layout) and ``weight`` (fp32)."""
    from taehv_slurm.trainer import rgb_head_kernels

    return rgb_head_kernels.backward(grad, stacked, weight, frames)


@relu_conv3x3_frames_backward.register_fake
def _(grad: torch.Tensor, stacked: torch.Tensor, weight: torch.Tensor,
      frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (stacked.new_empty_strided(stacked.shape, stacked.stride()),
            weight.new_empty(weight.shape, dtype=torch.float32))


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    stacked, weight, _, frames = inputs
    ctx.save_for_backward(stacked, weight)
    ctx.frames = frames


def _backward(ctx, grad: torch.Tensor) -> tuple:
    stacked, weight = ctx.saved_tensors
    grad_stacked, grad_weight = relu_conv3x3_frames_backward(grad, stacked, weight, ctx.frames)
    return grad_stacked, grad_weight, grad.float().sum((0, 2, 3)), None


relu_conv3x3_frames.register_autograd(_backward, setup_context=_setup_context)


def _frame_shape(stacked_shape, frames: int) -> list[int]:
    n, c, h, w = stacked_shape
    return [n * frames, c // frames, h, w]


@register_flop_formula(torch.ops.taehv.relu_conv3x3_frames)
def _forward_flops(stacked_shape, w_shape, b_shape, frames, *args, out_shape, **kwargs) -> int:
    return conv_flop_count(_frame_shape(stacked_shape, frames), w_shape, out_shape)


@register_flop_formula(torch.ops.taehv.relu_conv3x3_frames_backward)
def _backward_flops(grad_shape, stacked_shape, w_shape, frames, *args, out_shape, **kwargs) -> int:
    return 2 * conv_flop_count(_frame_shape(stacked_shape, frames), w_shape, grad_shape)
