"""The encoder's first conv + bias + ReLU as one op with Triton kernels (`FAST_PATHS["triton_first_conv"]`).

On frame pairs (model.py, `pair_first_stage`) the first conv reads 8 channels and writes 128 at full
resolution. cuDNN ran it at a tenth of its usual rate, and its backward was three passes over the 2.1 GB
output gradient (mask it, store it, read it again for the weight gradient). `first_conv_relu` runs the
forward as gathered matrix products and the backward as one pass that masks the gradient and sums the bias
and weight gradients in registers (`first_conv_kernels.py`). The input is the clip, so there is no input
gradient: the op is used only where the input needs none.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

from taehv_slurm.trainer.rgb_head import HAS_TRITON

MAX_INPUT_CHANNELS = 16  # the gathered taps fit one tile


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def first_conv_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where the kernels run: CUDA, half precision, channels-last, a 3×3 kernel, few input channels and
    channel counts that are powers of two, and no gradient wanted for the input."""
    c_out, c_in = weight.shape[:2]
    return (HAS_TRITON and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and not x.requires_grad
            and x.is_contiguous(memory_format=torch.channels_last) and tuple(weight.shape[2:]) == (3, 3)
            and _power_of_two(c_in) and c_in <= MAX_INPUT_CHANNELS and _power_of_two(c_out)
            and 16 <= c_out <= 256)


@torch.library.custom_op("taehv::first_conv_relu", mutates_args=())
def first_conv_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """relu(conv3x3(x, weight, bias, padding=1)), channels-last in x's dtype. Called where
    `first_conv_runs`."""
    from taehv_slurm.trainer import first_conv_kernels

    return first_conv_kernels.forward(x, weight, bias)


@first_conv_relu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n, _, h, w = x.shape
    return x.new_empty(n, weight.shape[0], h, w).contiguous(memory_format=torch.channels_last)


@torch.library.custom_op("taehv::first_conv_relu_backward", mutates_args=())
def first_conv_relu_backward(grad: torch.Tensor, out: torch.Tensor,
                             x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight gradient, bias gradient) in float32 of `first_conv_relu`, from its output and input."""
    from taehv_slurm.trainer import first_conv_kernels

    return first_conv_kernels.backward(grad.contiguous(memory_format=torch.channels_last), out, x)


@first_conv_relu_backward.register_fake
def _(grad: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c_out, c_in = out.shape[1], x.shape[1]
    return out.new_empty(c_out, c_in, 3, 3, dtype=torch.float32), out.new_empty(c_out, dtype=torch.float32)


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, output)
    ctx.dtypes = (weight.dtype, bias.dtype)


def _backward(ctx, grad: torch.Tensor) -> tuple:
    x, out = ctx.saved_tensors
    dw, db = first_conv_relu_backward(grad, out, x)
    return None, dw.to(ctx.dtypes[0]), db.to(ctx.dtypes[1])


first_conv_relu.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.taehv.first_conv_relu)
def _forward_flops(x_shape, w_shape, *args, out_shape, **kwargs) -> int:
    return conv_flop_count(x_shape, w_shape, out_shape)

