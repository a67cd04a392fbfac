"""TAEHV's layers (MemBlock, TPool, TGrow) and how a stack of them runs in training.

`apply_stack` runs an encoder or decoder stack on all frames at once, with the exact reformulations
of `FAST_PATHS` (each checked against the published block order, outputs and gradients, in
tests/test_model.py): linear chains folded into one conv, the RGB head on a space-to-depth layout, the
first stage on frame pairs, each conv + bias (+ residual) + ReLU as one cuDNN kernel on a GPU
(`conv3x3_relu`: tests/test_fused_conv.py) whose backward masks the gradient and sums the bias gradient
in one Triton kernel (relu_grad_kernel.py), the first stage's conv + ReLU (few input channels) as Triton
kernels (first_conv.py: tests/test_first_conv.py), and the head's ReLU + conv as Triton kernels on a GPU
(rgb_head.py: tests/test_rgb_head.py). `TAEHV_FAST_PATHS_OFF` turns paths off by name in every process.
docs/benchmarks.md has what each one is worth.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

from taehv_slurm.trainer.first_conv import first_conv_relu, first_conv_runs
from taehv_slurm.trainer.rgb_head import HAS_TRITON, relu_conv3x3_frames, triton_head_runs


def conv3x3(c_in: int, c_out: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=bias)


class Clamp(nn.Module):
    """Soft clamp of latents to (-3, 3); smooth, so it passes gradients everywhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """Residual block that sees its own input and the previous frame's input (channel concat)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            conv3x3(2 * c_in, c_out), nn.ReLU(),
            conv3x3(c_out, c_out), nn.ReLU(),
            conv3x3(c_out, c_out),
        )
        self.skip = nn.Conv2d(c_in, c_out, 1, bias=False) if c_in != c_out else nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(torch.cat((x, past), dim=1)) + self.skip(x))

    def forward_fused(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        """The same block with each conv → (+ skip) → ReLU as one `conv3x3_relu`."""
        h = fused_conv3x3_relu(self.conv[0], torch.cat((x, past), dim=1))
        return fused_conv3x3_relu(self.conv[4], fused_conv3x3_relu(self.conv[2], h), residual=self.skip(x))

    def forward_split(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """The same block without materialising concat(x, past): a per-frame conv of the previous
        frame is the previous frame of the per-frame conv, so one conv of x with the two weight halves
        stacked on the output gives both terms; the second is shifted by one frame and added."""
        first = self.conv[0]
        c_out, c_in = first.out_channels, first.in_channels // 2
        weight = torch.cat((first.weight[:, :c_in], first.weight[:, c_in:]), dim=0)
        both = F.conv2d(x, weight, padding=1)
        h = both[:, :c_out] + _previous_frames(both[:, c_out:], n) + first.bias.view(1, -1, 1, 1)
        return self.act(self.conv[2:](F.relu(h)) + self.skip(x))


def _is_channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _format_of(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if _is_channels_last(x) else torch.contiguous_format


class TPool(nn.Module):
    """Merge ``stride`` consecutive frames (stacked on channels) into one with a 1×1 conv."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels * stride, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.stack_frames(x))

    def stack_frames(self, x: torch.Tensor) -> torch.Tensor:
        """(N·T)×C×H×W → (N·T/stride)×(stride·C)×H×W, frame k of each group in channel block k."""
        nt, c, h, w = x.shape
        if self.stride > 1 and _is_channels_last(x):
            # ONE copy that stays channels_last (a plain reshape copies into NCHW and the next conv
            # copies it back).
            nhwc = x.permute(0, 2, 3, 1).reshape(nt // self.stride, self.stride, h, w, c)
            grouped = nhwc.permute(0, 2, 3, 1, 4).reshape(nt // self.stride, h, w, self.stride * c)
            return grouped.permute(0, 3, 1, 2)
        # Frames of one clip are adjacent in the folded batch, so this groups frames within a clip.
        return x.reshape(nt // self.stride, self.stride * c, h, w)


class TGrow(nn.Module):
    """Split each frame into ``stride`` frames: a 1×1 conv to ``channels·stride``, then unstack."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Output channel block k becomes frame k of the group (the published weights assume this).
        return _unstack_frames(self.conv(x), self.stride)


def _unstack_frames(y: torch.Tensor, stride: int, up: int = 1) -> torch.Tensor:
    """Inverse of stacking: (N·T)×(stride·C·up²)×h×w with channels ordered (frame, c, row phase,
    column phase) → (N·T·stride)×C×(up·h)×(up·w), in ONE copy that keeps the input's memory format."""
    nt, _, h, w = y.shape
    if stride == 1 and up == 1:
        return y
    c = y.shape[1] // (stride * up * up)
    if _is_channels_last(y):
        nhwc = y.permute(0, 2, 3, 1).reshape(nt, h, w, stride, c, up, up)
        frames = nhwc.permute(0, 3, 1, 5, 2, 6, 4).reshape(nt * stride, h * up, w * up, c)
        return frames.permute(0, 3, 1, 2)
    frames = y.reshape(nt, stride, c, up, up, h, w).permute(0, 1, 2, 5, 3, 6, 4)
    return frames.reshape(nt * stride, c, h * up, w * up)


class _Nearest2x(torch.autograd.Function):
    """Nearest ×2 upsampling whose backward is a 2×2 sum (avg-pool × 4): the default backward
    scatters with atomics (index_put) and cost ~5 % of a training step on H200."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2, mode="nearest")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(grad, 2) * 4


def _previous_frames(x: torch.Tensor, n: int) -> torch.Tensor:
    """For each frame of (N·T)×C×H×W, the previous frame of the same clip (zeros for frame 0).

    One constant pad (pad 1 before, crop 1 after) on the time axis of the N×T view. The pad is applied
    on a view where time lies outside channels in memory, so the result keeps the input's layout
    (contiguous or channels_last) and reshapes back without a copy.
    """
    nt, c, h, w = x.shape
    x5 = x.reshape(n, nt // n, c, h, w)
    if x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last):
        return F.pad(x5, (0, 0, 0, 0, 0, 0, 1, -1)).reshape(nt, c, h, w)
    # channels_last: N×C×T×H×W is then channels_last_3d, which pad preserves.
    shifted = F.pad(x5.transpose(1, 2), (0, 0, 0, 0, 1, -1)).transpose(1, 2)
    return shifted.reshape(nt, c, h, w)


# Exact reformulations used in training (switchable for benchmarks; tests check each against the
# published block order, outputs and gradients). docs/benchmarks.md has what each one is worth.
FAST_PATHS = {
    "split_memblock": False,    # MemBlocks without the concat copy (slower: off)
    "pair_first_stage": True,   # the encoder's first stage on frame pairs
    "pad_first_conv": True,     # ... with its 6 input channels zero-padded to 8 (channels-last only)
    "pad_rgb_out": True,        # the RGB head's outputs padded with zero channels to a multiple of 16
    "fold_linear": True,        # TPool→conv and TGrow→Upsample→conv each as ONE conv (no upsampled tensor)
    "phase_head": True,         # the RGB head on the last stage's phase layout (with fold_linear)
    "fused_conv_relu": True,    # conv3x3 + bias (+ residual) + ReLU as one op: one cuDNN kernel on a GPU
    "triton_head": True,        # ... and its ReLU + head as Triton kernels on the stacked frames (on a GPU)
    "triton_relu_grad": True,   # ... and its backward's ReLU mask + bias gradient as one Triton kernel (GPU)
    "triton_first_conv": True,  # the first stage's conv + ReLU as Triton kernels, no stored masked gradient
    "copy_overlap": True,       # (train.py) each micro-batch copied to the GPU on a stream of its own
    "precompile": True,         # (engine.py) the compiled student saved whole, loaded by later starts
    "compile_aside": True,      # (precompile.py) ... and while no file has it, another process compiles it
    "one_pass_norm": True,      # (hunyuan_encoder.py) the teacher's GroupNorm statistics in one read, not two
}
FAST_PATHS_OFF_ENV = "TAEHV_FAST_PATHS_OFF"  # names turned off in every process of a run (benchmarks' A/B)


def _turn_off_from_env() -> None:
    names = [n for n in os.environ.get(FAST_PATHS_OFF_ENV, "").split(",") if n]
    if unknown := sorted(set(names) - set(FAST_PATHS)):
        raise ValueError(f"{FAST_PATHS_OFF_ENV} names {', '.join(unknown)}: use names of "
                         f"{', '.join(FAST_PATHS)}, comma-separated")
    for name in names:
        FAST_PATHS[name] = False


_turn_off_from_env()


def _phase_taps(up: int, like: torch.Tensor) -> torch.Tensor:
    """taps[a, p, o, d] = 1 where row d of a 3×3 kernel (dy = d − 1), applied at output phase a of an
    image made of ``up``×``up`` phases, reads input phase p at phase-grid row offset o − 1."""
    taps = torch.zeros(up, up, 3, 3, device=like.device, dtype=like.dtype)
    for a in range(up):
        for d in range(3):
            r = a + d - 1
            taps[a, r % up, r // up + 1, d] = 1
    return taps


def _like_input(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A composed weight in the input's dtype and memory format (cuDNN picks kernels by both)."""
    weight = weight.to(x.dtype)
    return weight.contiguous(memory_format=torch.channels_last) if _is_channels_last(x) else weight


def _cudnn_fuses(x: torch.Tensor) -> bool:
    """Whether `conv3x3_relu` runs as cuDNN's fused kernel: half precision, channels-last (where training
    runs and runtime fusion is supported). Not `torch.backends.cudnn.is_acceptable`: it refuses bf16."""
    return (x.is_cuda and torch.backends.cudnn.enabled and x.dtype in (torch.float16, torch.bfloat16)
            and _is_channels_last(x))


def _plain_conv3x3_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        residual: torch.Tensor | None) -> torch.Tensor:
    out = F.conv2d(x, weight, bias, padding=1)
    return F.relu(out if residual is None else out + residual)


def _triton_relu_grad_runs(grad: torch.Tensor, out: torch.Tensor) -> bool:
    c = out.shape[1]
    return (FAST_PATHS["triton_relu_grad"] and HAS_TRITON and out.is_cuda and c & (c - 1) == 0
            and _is_channels_last(out) and _is_channels_last(grad))


@torch.library.custom_op("taehv::relu_bias_grad", mutates_args=())
def relu_bias_grad(grad: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReLU's gradient from its output (aten's threshold_backward) and its sum over batch and pixels, the
    bias gradient of the conv before the ReLU, as one Triton kernel (relu_grad_kernel.py) that reads the
    gradient once for both. Called where `_triton_relu_grad_runs` (CUDA, channels-last, C a power of 2)."""
    from taehv_slurm.trainer import relu_grad_kernel

    return relu_grad_kernel.relu_bias_grad(grad, out)


@relu_bias_grad.register_fake
def _(grad: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(out), out.new_empty(out.shape[1])


@torch.library.custom_op("taehv::conv3x3_relu", mutates_args=())
def conv3x3_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """relu(conv3x3(x) + bias [+ residual]) with padding 1, in the input's memory format. On a GPU it is
    ONE cuDNN kernel (bias, residual and ReLU in the convolution's epilogue); compiled, the same sum is a
    convolution plus an elementwise kernel that reads and writes the activation once more. `weight`,
    `bias` and `residual` come in x's dtype and memory format."""
    if _cudnn_fuses(x):
        args = ([1, 1], [1, 1], [1, 1], 1)  # stride, padding, dilation, groups
        out = (torch.cudnn_convolution_relu(x, weight, bias, *args) if residual is None
               else torch.cudnn_convolution_add_relu(x, weight, residual, 1.0, bias, *args))
    else:
        out = _plain_conv3x3_relu(x, weight, bias, residual)
    return out.contiguous(memory_format=_format_of(x))  # what the fake below promises the compiler


@conv3x3_relu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
      residual: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], *x.shape[2:]).contiguous(memory_format=_format_of(x))


def _conv3x3_relu_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, _, residual = inputs
    ctx.save_for_backward(x, weight, output)
    ctx.has_residual = residual is not None


def _conv3x3_relu_backward(ctx, grad: torch.Tensor) -> tuple:
    x, weight, out = ctx.saved_tensors
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    if fused := _triton_relu_grad_runs(grad, out):
        grad, db = relu_bias_grad(grad, out)
    else:  # compiled: a masking kernel, and the bias gradient as a reduction that reads `grad` again
        grad = torch.ops.aten.threshold_backward(grad, out, 0)  # ReLU's gradient, from its output
    dx, dw, db_conv = torch.ops.aten.convolution_backward(
        grad, x, weight, [weight.shape[0]], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
        [needs_x, needs_weight, needs_bias and not fused])
    return dx, dw, db if fused else db_conv, grad if ctx.has_residual else None


conv3x3_relu.register_autograd(_conv3x3_relu_backward, setup_context=_conv3x3_relu_context)


@register_flop_formula(torch.ops.taehv.conv3x3_relu)
def _conv3x3_relu_flops(x_shape, w_shape, *args, out_shape, **kwargs) -> int:
    return conv_flop_count(x_shape, w_shape, out_shape)  # the convolution's (MFU counts convolutions)


def fused_conv3x3_relu(conv: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """relu(conv(x) [+ residual]) for a 3×3, stride-1, padding-1 conv with bias, its weight and bias
    overridable (composed weights): `conv3x3_relu` where cuDNN fuses it, elsewhere the plain ops (the
    compiler fuses those with their neighbours; the custom op is opaque to it)."""
    weight = conv.weight if weight is None else weight
    bias = conv.bias if bias is None else bias
    if torch.is_autocast_enabled(x.device.type):  # a custom op is not autocast: cast as F.conv2d would
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if residual is None and FAST_PATHS["triton_first_conv"] and first_conv_runs(x, weight):  # no input grad
        return first_conv_relu(x, weight.to(x.dtype), bias.to(x.dtype))
    if not _cudnn_fuses(x):
        return _plain_conv3x3_relu(x, weight, bias, residual)
    return conv3x3_relu(x, _like_input(weight, x), bias.to(x.dtype),
                        None if residual is None else residual.to(x.dtype))


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _upsampled_conv_weight(conv: nn.Conv2d, grow: TGrow, up: int) -> torch.Tensor:
    """The weight of ONE 3×3 conv on the low-resolution frames that equals TGrow (1×1) → nearest
    ×``up`` → ``conv`` (3×3, no bias): output channels are (new frame k, out channel, row phase, column
    phase). A nearest-upsampled image is constant on each up×up cell, so every output phase is a 3×3
    conv of the low-resolution input. Same FLOPs as the full-resolution conv, but the upsampled tensor
    (the decoder's largest activation) is never written or read, forward or backward."""
    with torch.autocast(conv.weight.device.type, enabled=False):  # compose in fp32; one rounding at use
        weight = _fp32(conv.weight)
        taps = _phase_taps(up, weight).sum(1)  # [a, o, d]: the input has a single phase
        w = torch.einsum("ocij,ayi,bxj->oabcyx", weight, taps, taps)
        grow_w = _fp32(grow.conv.weight).reshape(grow.stride, conv.in_channels, -1)  # block k → frame k
        w = torch.einsum("oabcyx,kcd->koabdyx", w, grow_w)
    return w.reshape(-1, grow.conv.in_channels, 3, 3)


def phase_conv_weight(conv: nn.Conv2d, up: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``conv`` (3×3, stride 1) as a conv on the up×up phase layout (space-to-depth): input channels
    (c, row phase, column phase), output channels (o, row phase, column phase) as pixel_shuffle reads."""
    with torch.autocast(conv.weight.device.type, enabled=False):
        weight = _fp32(conv.weight)
        taps = _phase_taps(up, weight)
        w = torch.einsum("ocij,apyi,bqxj->oabcpqyx", weight, taps, taps)
        bias = None if conv.bias is None else _fp32(conv.bias).repeat_interleave(up * up)
    return w.reshape(conv.out_channels * up * up, conv.in_channels * up * up, 3, 3), bias


def pooled_conv(pool: TPool, conv: nn.Conv2d, stacked: torch.Tensor) -> torch.Tensor:
    """TPool's 1×1 conv (no bias) then ``conv`` (no bias) as ONE conv of TPool's stacked frames: the
    pooled tensor is never stored."""
    with torch.autocast(conv.weight.device.type, enabled=False):
        w = torch.einsum("oicd,ij->ojcd", _fp32(conv.weight), _fp32(pool.conv.weight[:, :, 0, 0]))
    return F.conv2d(stacked, _like_input(w, stacked), stride=conv.stride, padding=conv.padding)


def folds_with_pool(blocks: list[nn.Module], i: int) -> bool:
    return FAST_PATHS["fold_linear"] and i < len(blocks) and isinstance(blocks[i], nn.Conv2d) \
        and blocks[i].bias is None


def upscale_of(block: nn.Module) -> int:
    return int(block.scale_factor) if isinstance(block, nn.Upsample) else 1  # type: ignore[arg-type]


def folds_grow_up_conv(blocks: list[nn.Module], i: int) -> bool:
    """With ``fold_linear``: blocks[i:i+3] is [Upsample or Identity, TGrow, bias-free 3×3 conv] (a
    decoder stage's tail)."""
    return (FAST_PATHS["fold_linear"] and i + 2 < len(blocks)
            and isinstance(blocks[i], (nn.Upsample, nn.Identity))
            and isinstance(blocks[i + 1], TGrow) and isinstance(blocks[i + 2], nn.Conv2d)
            and blocks[i + 2].kernel_size == (3, 3) and blocks[i + 2].bias is None)


def is_conv3x3_relu(blocks: list[nn.Module], i: int) -> bool:
    """With ``fused_conv_relu``: blocks[i:i+2] is a 3×3 conv (stride 1, padding 1, bias) then a ReLU."""
    conv = blocks[i]
    return (FAST_PATHS["fused_conv_relu"] and i + 1 < len(blocks) and isinstance(blocks[i + 1], nn.ReLU)
            and isinstance(conv, nn.Conv2d)
            and conv.kernel_size == (3, 3) and conv.stride == (1, 1) and conv.padding == (1, 1)
            and conv.dilation == (1, 1) and conv.groups == 1 and conv.padding_mode == "zeros"
            and conv.bias is not None)


def grow_up_stacked(blocks: list[nn.Module], i: int, x: torch.Tensor) -> torch.Tensor:
    """blocks[i:i+3] (see folds_grow_up_conv) as one low-resolution conv, its output channels (new frame,
    channel, row phase, column phase)."""
    up, grow, conv = upscale_of(blocks[i]), blocks[i + 1], blocks[i + 2]
    return F.conv2d(x, _like_input(_upsampled_conv_weight(conv, grow, up), x), padding=1)


def grow_up_conv(blocks: list[nn.Module], i: int, x: torch.Tensor) -> torch.Tensor:
    """Run blocks[i:i+3] (see folds_grow_up_conv) as one low-resolution conv plus one copy that places
    frames and phases."""
    return _unstack_frames(grow_up_stacked(blocks, i, x), blocks[i + 1].stride, upscale_of(blocks[i]))


def phase_head(stacked: torch.Tensor, frames: int, head: nn.Conv2d, up: int) -> torch.Tensor:
    """ReLU, then the RGB head (3×3) on the last stage's output left as ``frames`` frames × up×up phases
    on the channels (from `grow_up_stacked`); only the 3-channel result is shuffled into pixels. With
    ``triton_head`` on a GPU, one op reads the stacked frames in place (rgb_head.py); else they are copied
    into frames first."""
    weight, bias = phase_conv_weight(head, up)
    if FAST_PATHS["triton_head"] and triton_head_runs(stacked, weight):
        bias = weight.new_zeros(weight.shape[0]) if bias is None else bias
        out = relu_conv3x3_frames(stacked, weight, bias, frames)
    else:
        out = rgb_conv(F.relu(_unstack_frames(stacked, frames)), weight, bias)
    return F.pixel_shuffle(out, up)


def apply_stack(stack: nn.Sequential, x: torch.Tensor, n: int) -> torch.Tensor:
    """Run a stack on (N·T)×C×H×W, all frames at once; the frame count may change at TPool/TGrow.

    An [Upsample, TGrow] pair runs as TGrow then Upsample: a bias-free 1×1 conv commutes with nearest
    upsampling exactly, and at the lower resolution it costs a quarter of the work and memory. With
    ``fold_linear``, the linear runs TPool→conv and TGrow→Upsample→conv are each one conv.
    """
    blocks = list(stack)
    i = 0
    while i < len(blocks):
        block = blocks[i]
        if isinstance(block, MemBlock):
            if FAST_PATHS["split_memblock"]:
                x = block.forward_split(x, n)
            elif FAST_PATHS["fused_conv_relu"]:
                x = block.forward_fused(x, _previous_frames(x, n))
            else:
                x = block(x, _previous_frames(x, n))
        elif isinstance(block, TPool) and folds_with_pool(blocks, i + 1):
            x = pooled_conv(block, blocks[i + 1], block.stack_frames(x))
            i += 1
        elif folds_grow_up_conv(blocks, i):
            x = grow_up_conv(blocks, i, x)
            i += 2
        elif is_conv3x3_relu(blocks, i):
            x = fused_conv3x3_relu(block, x)
            i += 1
        elif isinstance(block, nn.Upsample):
            if i + 1 < len(blocks) and isinstance(blocks[i + 1], TGrow):
                x = blocks[i + 1](x)
                i += 1
            x = _Nearest2x.apply(x)
        else:
            x = block(x)
        i += 1
    return x


def rgb_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The decoder's head conv (3×3). Its few output channels suit the tensor cores badly: with
    ``pad_rgb_out`` the weight gets zero outputs up to a multiple of 16, and the extra channels are
    dropped (same values, a faster kernel)."""
    out_channels = weight.shape[0]
    if FAST_PATHS["pad_rgb_out"] and out_channels % 16:
        pad = -out_channels % 16
        weight = F.pad(weight, (0, 0, 0, 0, 0, 0, 0, pad))
        bias = None if bias is None else F.pad(bias, (0, pad))
    return F.conv2d(x, _like_input(weight, x), None if bias is None else bias.to(x.dtype),
                    padding=1)[:, :out_channels]
