"""TAEHV: a tiny causal video autoencoder (our own implementation, trainable).

Architecture facts follow the published model (madebyollin/taehv: its taehv.py and published weight files). The module tree
is laid out so that ``state_dict()`` keys and shapes equal the published weight files'
(``encoder.<i>.…`` / ``decoder.<i>.…`` indexed by position in two ``nn.Sequential`` stacks), so those
files load with :func:`load_published_weights`.

Differences from the published code, all for training:
- parallel mode only (frames folded into the batch); no Python loop over frames, no progress bars;
- no in-place activations or clamps (the published ``decode_video`` clamps in place, which zeroes the
  gradient of every pixel outside [0, 1]); ``decode_video(clamp=False)`` returns the raw output;
- the one cross-frame operation (MemBlock memory) is a single pad on the N×T view that keeps the
  input's memory format, so channels_last training does not pay for layout conversions;
- exact reformulations that save memory traffic (``FAST_PATHS``): linear chains folded into one conv,
  the RGB head on a space-to-depth layout, the first stage on frame pairs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE_CHANNELS = 3


@dataclass
class TAEHVConfig:
    """Shape of a TAEHV model. The defaults are the published HunyuanVideo ``taehv``."""

    latent_channels: int = 16
    patch_size: int = 1
    encoder_width: int = 64
    decoder_widths: tuple[int, int, int, int] = (256, 128, 64, 64)
    encoder_time_downscale: tuple[bool, bool, bool] = (True, True, False)
    decoder_time_upscale: tuple[bool, bool, bool] = (False, True, True)
    decoder_space_upscale: tuple[bool, bool, bool] = (True, True, True)

    def __post_init__(self) -> None:
        # YAML gives lists; keep tuples so configs compare and hash the same either way.
        for f in ("decoder_widths", "encoder_time_downscale", "decoder_time_upscale", "decoder_space_upscale"):
            setattr(self, f, tuple(getattr(self, f)))
        expected = {"decoder_widths": 4, "encoder_time_downscale": 3, "decoder_time_upscale": 3,
                    "decoder_space_upscale": 3}
        for f, n in expected.items():
            if len(getattr(self, f)) != n:
                raise ValueError(f"TAEHVConfig.{f} needs {n} entries, got {getattr(self, f)!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TAEHVConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown TAEHVConfig key {key!r}; known keys: {', '.join(sorted(known))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------
# Building blocks. Attribute names (conv, skip, act) and child order fix the state-dict keys.


def _conv3x3(c_in: int, c_out: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
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
            _conv3x3(2 * c_in, c_out), nn.ReLU(),
            _conv3x3(c_out, c_out), nn.ReLU(),
            _conv3x3(c_out, c_out),
        )
        self.skip = nn.Conv2d(c_in, c_out, 1, bias=False) if c_in != c_out else nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(torch.cat((x, past), dim=1)) + self.skip(x))

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
    "pad_rgb_out": True,        # the RGB head's outputs padded with zero channels to a multiple of 16
    "fold_linear": True,        # TPool→conv and TGrow→Upsample→conv each as ONE conv (no upsampled tensor)
    "phase_head": True,         # the RGB head on the last stage's phase layout (with fold_linear)
}


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


def _phase_conv_weight(conv: nn.Conv2d, up: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``conv`` (3×3, stride 1) as a conv on the up×up phase layout (space-to-depth): input channels
    (c, row phase, column phase), output channels (o, row phase, column phase) as pixel_shuffle reads."""
    with torch.autocast(conv.weight.device.type, enabled=False):
        weight = _fp32(conv.weight)
        taps = _phase_taps(up, weight)
        w = torch.einsum("ocij,apyi,bqxj->oabcpqyx", weight, taps, taps)
        bias = None if conv.bias is None else _fp32(conv.bias).repeat_interleave(up * up)
    return w.reshape(conv.out_channels * up * up, conv.in_channels * up * up, 3, 3), bias


def _pooled_conv(pool: TPool, conv: nn.Conv2d, stacked: torch.Tensor) -> torch.Tensor:
    """TPool's 1×1 conv (no bias) then ``conv`` (no bias) as ONE conv of TPool's stacked frames: the
    pooled tensor is never stored."""
    with torch.autocast(conv.weight.device.type, enabled=False):
        w = torch.einsum("oicd,ij->ojcd", _fp32(conv.weight), _fp32(pool.conv.weight[:, :, 0, 0]))
    return F.conv2d(stacked, _like_input(w, stacked), stride=conv.stride, padding=conv.padding)


def _folds_with_pool(blocks: list[nn.Module], i: int) -> bool:
    return FAST_PATHS["fold_linear"] and i < len(blocks) and isinstance(blocks[i], nn.Conv2d) \
        and blocks[i].bias is None


def _upscale(block: nn.Module) -> int:
    return int(block.scale_factor) if isinstance(block, nn.Upsample) else 1  # type: ignore[arg-type]


def _folds_grow_up_conv(blocks: list[nn.Module], i: int) -> bool:
    """With ``fold_linear``: blocks[i:i+3] is [Upsample or Identity, TGrow, bias-free 3×3 conv] (a
    decoder stage's tail)."""
    return (FAST_PATHS["fold_linear"] and i + 2 < len(blocks) and isinstance(blocks[i], (nn.Upsample, nn.Identity))
            and isinstance(blocks[i + 1], TGrow) and isinstance(blocks[i + 2], nn.Conv2d)
            and blocks[i + 2].kernel_size == (3, 3) and blocks[i + 2].bias is None)


def _grow_up_conv(blocks: list[nn.Module], i: int, x: torch.Tensor, keep_phases: bool = False) -> torch.Tensor:
    """Run blocks[i:i+3] (see _folds_grow_up_conv) as one low-resolution conv plus one copy that places
    frames and phases. ``keep_phases`` leaves the up×up phases on the channels (for the phase head)."""
    up, grow, conv = _upscale(blocks[i]), blocks[i + 1], blocks[i + 2]
    y = F.conv2d(x, _like_input(_upsampled_conv_weight(conv, grow, up), x), padding=1)
    return _unstack_frames(y, grow.stride, 1 if keep_phases else up)


def _apply_stack(stack: nn.Sequential, x: torch.Tensor, n: int) -> torch.Tensor:
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
            x = block.forward_split(x, n) if FAST_PATHS["split_memblock"] else block(x, _previous_frames(x, n))
        elif isinstance(block, TPool) and _folds_with_pool(blocks, i + 1):
            x = _pooled_conv(block, blocks[i + 1], block.stack_frames(x))
            i += 1
        elif _folds_grow_up_conv(blocks, i):
            x = _grow_up_conv(blocks, i, x)
            i += 2
        elif isinstance(block, nn.Upsample):
            if i + 1 < len(blocks) and isinstance(blocks[i + 1], TGrow):
                x = blocks[i + 1](x)
                i += 1
            x = _Nearest2x.apply(x)
        else:
            x = block(x)
        i += 1
    return x


def _rgb_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The decoder's head conv (3×3). Its few output channels suit the tensor cores badly: with
    ``pad_rgb_out`` the weight gets zero outputs up to a multiple of 16, and the extra channels are
    dropped (same values, a faster kernel)."""
    out_channels = weight.shape[0]
    if FAST_PATHS["pad_rgb_out"] and out_channels % 16:
        pad = -out_channels % 16
        weight = F.pad(weight, (0, 0, 0, 0, 0, 0, 0, pad))
        bias = None if bias is None else F.pad(bias, (0, pad))
    return F.conv2d(x, _like_input(weight, x), None if bias is None else bias.to(x.dtype), padding=1)[:, :out_channels]


# ----------------------------------------------------------------------------------------------------


class TAEHV(nn.Module):
    """Tiny causal video autoencoder: N×T×3×H×W in [0, 1] ↔ N×ceil(T/4)×C×H/8×W/8 latents."""

    def __init__(self, config: TAEHVConfig | None = None) -> None:
        super().__init__()
        cfg = config if config is not None else TAEHVConfig()
        self.config = cfg
        p2 = cfg.patch_size**2
        ew = cfg.encoder_width

        def enc_stage(downscale: bool) -> list[nn.Module]:
            return [TPool(ew, 2 if downscale else 1), _conv3x3(ew, ew, stride=2, bias=False),
                    MemBlock(ew, ew), MemBlock(ew, ew), MemBlock(ew, ew)]

        self.encoder = nn.Sequential(
            _conv3x3(IMAGE_CHANNELS * p2, ew), nn.ReLU(),
            *enc_stage(cfg.encoder_time_downscale[0]),
            *enc_stage(cfg.encoder_time_downscale[1]),
            *enc_stage(cfg.encoder_time_downscale[2]),
            _conv3x3(ew, cfg.latent_channels),
        )

        w = cfg.decoder_widths

        def dec_stage(i: int) -> list[nn.Module]:
            # Identity for a disabled upsample keeps the block count, hence the state-dict indices.
            up = nn.Upsample(scale_factor=2, mode="nearest") if cfg.decoder_space_upscale[i] else nn.Identity()
            return [MemBlock(w[i], w[i]), MemBlock(w[i], w[i]), MemBlock(w[i], w[i]), up,
                    TGrow(w[i], 2 if cfg.decoder_time_upscale[i] else 1), _conv3x3(w[i], w[i + 1], bias=False)]

        self.decoder = nn.Sequential(
            Clamp(), _conv3x3(cfg.latent_channels, w[0]), nn.ReLU(),
            *dec_stage(0), *dec_stage(1), *dec_stage(2),
            nn.ReLU(), _conv3x3(w[3], IMAGE_CHANNELS * p2),
        )

        self.t_downscale = 2 ** sum(bool(d) for d in cfg.encoder_time_downscale)
        self.t_upscale = 2 ** sum(bool(u) for u in cfg.decoder_time_upscale)
        # The decoder's first t_upscale - 1 frames have no input counterpart (causal warm-up).
        self.frames_to_trim = self.t_upscale - 1
        self.space_downscale = 8 * cfg.patch_size
        self.space_upscale = cfg.patch_size * 2 ** sum(bool(u) for u in cfg.decoder_space_upscale)

    def encode_video(self, x: torch.Tensor) -> torch.Tensor:
        """N×T×3×H×W in [0, 1] → N×ceil(T/t_downscale)×latent_channels×H/8×W/8.

        T is padded at the end by repeating the last frame. H and W must be multiples of 8·patch_size.
        """
        if x.ndim != 5 or x.shape[2] != IMAGE_CHANNELS:
            raise ValueError(f"encode_video expects N×T×3×H×W frames, got shape {tuple(x.shape)}")
        n, t, c, h, w = x.shape
        if h % self.space_downscale or w % self.space_downscale:
            raise ValueError(f"encode_video: H×W={h}×{w} must be multiples of {self.space_downscale}")
        pad = -t % self.t_downscale
        if pad:
            x = torch.cat((x, x[:, -1:].expand(n, pad, c, h, w)), dim=1)
            t += pad
        x = x.reshape(n * t, c, h, w)
        if self.config.patch_size > 1:
            x = F.pixel_unshuffle(x, self.config.patch_size)
        first_pool = self.encoder[2]
        if FAST_PATHS["pair_first_stage"] and first_pool.stride == 2:
            stacked = self._first_stage_on_pairs(x)
            if _folds_with_pool(list(self.encoder), 3):
                z = _apply_stack(self.encoder[4:], _pooled_conv(first_pool, self.encoder[3], stacked), n)
            else:
                z = _apply_stack(self.encoder[3:], first_pool.conv(stacked), n)
        else:
            z = _apply_stack(self.encoder, x, n)
        return z.reshape(n, -1, *z.shape[1:])

    def _first_stage_on_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """conv → ReLU → TPool(2)'s frame stacking, with each pair of frames as one 2×3-channel image: a
        block-diagonal conv writes both frames' features side by side in the channels, which is exactly
        the layout the pooling 1×1 conv reads, so the full-resolution frames→channels reshape (a copy of
        the largest activation) disappears; the 6-channel input also suits the tensor cores better."""
        conv = self.encoder[0]
        zeros = torch.zeros_like(conv.weight)
        weight = torch.cat((torch.cat((conv.weight, zeros), 1), torch.cat((zeros, conv.weight), 1)), 0)
        nt, c, h, w = x.shape
        pairs = x.reshape(nt // 2, 2 * c, h, w)  # frames 2j, 2j+1 are adjacent: a view for NCHW input
        if self.encoder[3].weight.is_contiguous(memory_format=torch.channels_last):
            pairs = pairs.contiguous(memory_format=torch.channels_last)
        return F.relu(F.conv2d(pairs, weight, torch.cat((conv.bias, conv.bias)), padding=1))

    def decode_video(self, z: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """N×L×latent_channels×h×w → N×(t_upscale·L − frames_to_trim)×3×8h×8w.

        ``clamp=False`` returns the raw decoder output: take pixel losses on it (a clamp would cut
        the gradient of every pixel outside [0, 1]). ``clamp=True`` clamps out of place.
        """
        if z.ndim != 5 or z.shape[2] != self.config.latent_channels:
            raise ValueError(f"decode_video expects N×L×{self.config.latent_channels}×h×w latents, "
                             f"got shape {tuple(z.shape)}")
        n, length, c, h, w = z.shape
        x = z.reshape(n * length, c, h, w)
        blocks, head = list(self.decoder), self.decoder[-1]
        tail = len(blocks) - 5  # [Upsample, TGrow, conv, ReLU, head]
        if (FAST_PATHS["phase_head"] and _folds_grow_up_conv(blocks, tail)
                and _upscale(blocks[tail]) > 1 and isinstance(blocks[tail + 3], nn.ReLU)):
            # The last stage's conv leaves its output as up×up phases on the channels and the head runs
            # on that layout, so no full-resolution 64-channel tensor is ever laid out as pixels; only
            # the 3-channel result is shuffled into place.
            up = _upscale(blocks[tail])
            x = F.relu(_grow_up_conv(blocks, tail, _apply_stack(self.decoder[:tail], x, n), keep_phases=True))
            x = F.pixel_shuffle(_rgb_conv(x, *_phase_conv_weight(head, up)), up)
        else:
            x = _rgb_conv(_apply_stack(self.decoder[:-1], x, n), head.weight, head.bias)
        if self.config.patch_size > 1:
            x = F.pixel_shuffle(x, self.config.patch_size)
        x = x.reshape(n, -1, *x.shape[1:])[:, self.frames_to_trim:]
        return x.clamp(0, 1) if clamp else x

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training pass: (latents, raw decoded frames). Decoded frame i matches input frame i; the
        last frames_to_trim input frames have no decoded counterpart (the published training recipe
        compares the decoder output with frames[:, :-frames_to_trim])."""
        z = self.encode_video(x)
        return z, self.decode_video(z, clamp=False)


def init_for_training(model: TAEHV) -> None:
    """Initialise a TAEHV to train from scratch (the published file gives no init).

    PyTorch's default conv init shrinks the signal by ~1/√3 per layer, so after ~25 layers the decoder's
    output hardly depends on its input (std 0.004 for inputs of std 0.2), and training collapses to
    predicting the mean colour. He-normal weights keep the scale through the ReLUs; each residual branch
    (a MemBlock's last conv) and the RGB head start at 0.1× so the sum does not grow with depth; the RGB
    bias starts at mid-grey (0.5) as in the author's training example.
    """
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    with torch.no_grad():
        for block in model.modules():
            if isinstance(block, MemBlock):
                block.conv[-1].weight.mul_(0.1)
        head = model.decoder[-1]
        head.weight.mul_(0.1)
        head.bias.fill_(0.5)


# ----------------------------------------------------------------------------------------------------
# Published weights


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: expected a flat state dict, got {type(sd).__name__}")
    return sd


def _patch_tgrow(model: TAEHV, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stored TGrow with more output frames than the model's (time upscale turned off here) keeps
    the channels of its LAST output frame, as the published ``patch_tgrow_layers`` does."""
    own = model.state_dict()
    for i, block in enumerate(model.decoder):
        key = f"decoder.{i}.conv.weight"
        if isinstance(block, TGrow) and key in sd and sd[key].shape[0] > own[key].shape[0]:
            sd[key] = sd[key][-own[key].shape[0]:]
    return sd


def _field_for(model: TAEHV, key: str, stored: torch.Size, own: torch.Size) -> str:
    """The config field that most likely explains a shape mismatch at ``key``."""
    stack_name, idx, *_ = key.split(".")
    stack = getattr(model, stack_name)
    i = int(idx)
    block = stack[i]
    out_differs, in_differs = stored[0] != own[0], len(stored) > 1 and stored[1] != own[1]
    last_conv = len(stack) - 1
    if stack_name == "encoder":
        if i == 0 and in_differs:
            return "patch_size"
        if i == last_conv and out_differs:
            return "latent_channels"
        if isinstance(block, TPool) and in_differs and not out_differs:
            return "encoder_time_downscale"
        return "encoder_width"
    if i == 1 and in_differs:
        return "latent_channels"
    if i == last_conv and out_differs:
        return "patch_size"
    if isinstance(block, TGrow) and out_differs and not in_differs:
        return "decoder_time_upscale"
    return "decoder_widths"


def _check_compatible(model: TAEHV, sd: dict[str, torch.Tensor], path: Path) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        raise ValueError(
            f"{path}: state-dict keys do not match TAEHV (missing {len(missing)}, e.g. "
            f"{missing[:2]}; unexpected {len(unexpected)}, e.g. {unexpected[:2]}); is it a base-architecture "
            f"TAEHV file (not a '_super' decoder)? check encoder_width/decoder_widths")
    for k, v in own.items():
        if sd[k].shape != v.shape:
            field = _field_for(model, k, sd[k].shape, v.shape)
            raise ValueError(
                f"{path}: {k} has shape {tuple(sd[k].shape)} in the file but {tuple(v.shape)} in the model; "
                f"likely TAEHVConfig.{field} differs (model has {field}={getattr(model.config, field)!r})")


def load_published_weights(model: TAEHV, path: str | Path) -> None:
    """Load a published (or our own, same layout) ``.pth`` / ``.safetensors`` state dict, strictly."""
    path = Path(path)
    sd = _patch_tgrow(model, dict(_read_state_dict(path)))
    _check_compatible(model, sd, path)
    model.load_state_dict(sd, strict=True)


# ----------------------------------------------------------------------------------------------------
# Size and cost


def param_counts(model: TAEHV) -> dict[str, int]:
    enc = sum(p.numel() for p in model.encoder.parameters())
    dec = sum(p.numel() for p in model.decoder.parameters())
    return {"encoder": enc, "decoder": dec, "total": sum(p.numel() for p in model.parameters())}


def _conv_flops(conv: nn.Conv2d, frames: int, h: int, w: int) -> tuple[int, int, int]:
    """(2·MACs, output h, output w) of one Conv2d applied to ``frames`` images of h×w."""
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    ph, pw = conv.padding  # type: ignore[misc]
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    macs = frames * oh * ow * conv.out_channels * (conv.in_channels // conv.groups) * kh * kw
    return 2 * macs, oh, ow


def _stack_flops(stack: nn.Sequential, t: int, h: int, w: int) -> tuple[int, int, int, int]:
    """Walk a stack's shapes analytically: (conv FLOPs, frames, h, w) after the stack."""
    total = 0
    blocks = list(stack)
    for i, block in enumerate(blocks):
        if isinstance(block, TGrow) and i and isinstance(blocks[i - 1], nn.Upsample):
            # _apply_stack runs this TGrow before the upsample, at the lower resolution.
            scale = int(blocks[i - 1].scale_factor)  # type: ignore[arg-type]
            total += _conv_flops(block.conv, t, h // scale, w // scale)[0]
            t *= block.stride
        elif isinstance(block, nn.Conv2d):
            f, h, w = _conv_flops(block, t, h, w)
            total += f
        elif isinstance(block, MemBlock):
            for conv in (m for m in block.modules() if isinstance(m, nn.Conv2d)):
                total += _conv_flops(conv, t, h, w)[0]  # all stride 1, "same" padding
        elif isinstance(block, TPool):
            t //= block.stride
            total += _conv_flops(block.conv, t, h, w)[0]
        elif isinstance(block, TGrow):
            total += _conv_flops(block.conv, t, h, w)[0]
            t *= block.stride
        elif isinstance(block, nn.Upsample):
            h, w = h * int(block.scale_factor), w * int(block.scale_factor)  # type: ignore[arg-type]
    return total, t, h, w


def conv_flops_per_clip(config: TAEHVConfig, frames: int, height: int, width: int) -> dict[str, int]:
    """Forward FLOPs (2·MACs) of all convolutions for one clip: encoder on ``frames`` frames of
    height×width, decoder on the resulting latents. Counted from layer shapes (no compute)."""
    with torch.device("meta"):
        model = TAEHV(config)
    p = config.patch_size
    t = math.ceil(frames / model.t_downscale) * model.t_downscale
    enc, lat_t, lat_h, lat_w = _stack_flops(model.encoder, t, height // p, width // p)
    dec, _, _, _ = _stack_flops(model.decoder, lat_t, lat_h, lat_w)
    return {"encoder": enc, "decoder": dec, "total": enc + dec}
