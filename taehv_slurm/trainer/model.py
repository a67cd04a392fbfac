"""TAEHV: a tiny causal video autoencoder (our own implementation, trainable).

Architecture facts follow the published model (madebyollin/taehv: its taehv.py and published weight files).
The module tree is laid out so that ``state_dict()`` keys and shapes equal the published weight files'
(``encoder.<i>.…`` / ``decoder.<i>.…`` indexed by position in two ``nn.Sequential`` stacks), so those
files load with :func:`load_published_weights`.

Differences from the published code, all for training:
- parallel mode only (frames folded into the batch); no Python loop over frames, no progress bars;
- no in-place activations or clamps (the published ``decode_video`` clamps in place, which zeroes the
  gradient of every pixel outside [0, 1]); ``decode_video(clamp=False)`` returns the raw output;
- the one cross-frame operation (MemBlock memory) is a single pad on the N×T view that keeps the
  input's memory format, so channels_last training does not pay for layout conversions;
- exact reformulations that save memory traffic (``FAST_PATHS``): linear chains folded into one conv,
  the RGB head on a space-to-depth layout (on a GPU, Triton kernels that read the last stage's output in
  place), the first stage on frame pairs.
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

from taehv_slurm.trainer.layers import (
    FAST_PATHS,
    Clamp,
    MemBlock,
    TGrow,
    TPool,
    apply_stack,
    conv3x3,
    folds_grow_up_conv,
    folds_with_pool,
    fused_conv3x3_relu,
    grow_up_stacked,
    phase_head,
    pooled_conv,
    rgb_conv,
    upscale_of,
)

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
        for f in ("decoder_widths", "encoder_time_downscale", "decoder_time_upscale",
                  "decoder_space_upscale"):
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
            return [TPool(ew, 2 if downscale else 1), conv3x3(ew, ew, stride=2, bias=False),
                    MemBlock(ew, ew), MemBlock(ew, ew), MemBlock(ew, ew)]

        self.encoder = nn.Sequential(
            conv3x3(IMAGE_CHANNELS * p2, ew), nn.ReLU(),
            *enc_stage(cfg.encoder_time_downscale[0]),
            *enc_stage(cfg.encoder_time_downscale[1]),
            *enc_stage(cfg.encoder_time_downscale[2]),
            conv3x3(ew, cfg.latent_channels),
        )

        w = cfg.decoder_widths

        def dec_stage(i: int) -> list[nn.Module]:
            # Identity for a disabled upsample keeps the block count, hence the state-dict indices.
            up = (nn.Upsample(scale_factor=2, mode="nearest") if cfg.decoder_space_upscale[i]
                  else nn.Identity())
            return [MemBlock(w[i], w[i]), MemBlock(w[i], w[i]), MemBlock(w[i], w[i]), up,
                    TGrow(w[i], 2 if cfg.decoder_time_upscale[i] else 1), conv3x3(w[i], w[i + 1], bias=False)]

        self.decoder = nn.Sequential(
            Clamp(), conv3x3(cfg.latent_channels, w[0]), nn.ReLU(),
            *dec_stage(0), *dec_stage(1), *dec_stage(2),
            nn.ReLU(), conv3x3(w[3], IMAGE_CHANNELS * p2),
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
            if folds_with_pool(list(self.encoder), 3):
                z = apply_stack(self.encoder[4:], pooled_conv(first_pool, self.encoder[3], stacked), n)
            else:
                z = apply_stack(self.encoder[3:], first_pool.conv(stacked), n)
        else:
            z = apply_stack(self.encoder, x, n)
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
            if FAST_PATHS["pad_first_conv"] and (2 * c) % 8:
                # 8 channels (16-byte pixels; the channels-last copy writes the zeros) make the stage
                # about 0.5 ms a step faster on an H200 (docs/benchmarks.md)
                extra = (0, 0, 0, 0, 0, -(2 * c) % 8)
                pairs, weight = F.pad(pairs, extra), F.pad(weight, extra)
            pairs = pairs.contiguous(memory_format=torch.channels_last)
        bias = torch.cat((conv.bias, conv.bias))
        if FAST_PATHS["fused_conv_relu"]:
            return fused_conv3x3_relu(conv, pairs, weight, bias)
        return F.relu(F.conv2d(pairs, weight, bias, padding=1))

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
        if (FAST_PATHS["phase_head"] and folds_grow_up_conv(blocks, tail)
                and upscale_of(blocks[tail]) > 1 and isinstance(blocks[tail + 3], nn.ReLU)):
            # The last stage's conv leaves its output as up×up phases on the channels and the head runs
            # on that layout, so no full-resolution 64-channel tensor is ever laid out as pixels; only
            # the 3-channel result is shuffled into place.
            stacked = grow_up_stacked(blocks, tail, apply_stack(self.decoder[:tail], x, n))
            x = phase_head(stacked, blocks[tail + 1].stride, head, upscale_of(blocks[tail]))
        else:
            x = rgb_conv(apply_stack(self.decoder[:-1], x, n), head.weight, head.bias)
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
