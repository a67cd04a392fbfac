"""HunyuanVideo's VAE encoder, read from a diffusers folder without importing diffusers, arranged for speed.

Why our own module: on every rank that loads a teacher, `import diffusers` took 9–10 s on an H100 machine
(it imports every autoencoder, the UNet blocks, its transformer models and Hugging Face transformers; the
teacher needs none of them; docs/benchmarks.md). This
module is the encoder alone: the same parameter names as diffusers' `AutoencoderKLHunyuanVideo` (its
`encoder.*` and `quant_conv.*` weights load unchanged from `diffusion_pytorch_model.safetensors`), the same
math, tested against diffusers' own latents (tests/test_teacher.py). Its computation differs from diffusers'
only in order and layout, for speed (compiled, batch 2 of 13×480×720: 7.9 → 12.1–12.25 clips/s on an H100):

- The mid-block attention: diffusers builds a dense (T·h·w)² causal mask (0.9 GB per clip at 480×720) and
  runs the masked attention. Frame t's tokens see frames ≤ t, so attending per frame to the frames so far is
  the same softmax without the mask (masked keys add exp(−inf) = 0): less memory, no mask to build.
- channels-last (NDHWC, `use_channels_last`, what `Teacher.compile` compiles): cuDNN's 3-D convolutions read
  and write NDHWC; in NCDHW every convolution pays a transpose in and out (16 % of the compiled encoder's
  GPU time).
- GroupNorm statistics from per-channel sums (channels-last only): in NDHWC a group's channels are interleaved
  with all the others, and Inductor's GroupNorm reductions took ~4× as long as in NCDHW (80 of 240 ms a call
  on an H200), more than the transposes saved. Summing per channel first is a coalesced column reduction; a
  group's sums are added after (two passes, the variance about the mean).
- Each convolution's replication padding is applied to the GroupNorm's input, not to its output
  (`GroupNorm.silu_padded`): the same values, and Inductor no longer stores the normalised tensor in float32
  to pad it in a second kernel (1.05× a call).
- The attention as two matrix products with float32 logits (`attend`): the fused kernels take head sizes of
  at most 256, and at 512 PyTorch's memory-efficient one was slower (1.035× a call).
- The first convolution (3 input channels) over space, its 3 time taps stacked as 9 (→ 16) input channels
  (`CausalConv3d.use_time_taps_as_channels`): stacking and convolution 2.6 ms instead of 7.9 (1.02× a
  call).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layers import FAST_PATHS

CLASS_NAME = "AutoencoderKLHunyuanVideo"  # diffusers' class, named in the folder's config.json
WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = WEIGHTS + ".index.json"  # a sharded save
ENCODER_PREFIXES = ("encoder.", "quant_conv.")  # the parameters of the VAE that encode
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # both torch's SiLU in diffusers


@dataclasses.dataclass(frozen=True)
class EncoderSettings:
    """The encoder's part of an `AutoencoderKLHunyuanVideo` config (diffusers' defaults)."""

    in_channels: int = 3
    latent_channels: int = 16
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    spatial_compression_ratio: int = 8
    temporal_compression_ratio: int = 4
    mid_block_add_attention: bool = True
    scaling_factor: float = 0.476986

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderSettings | None:
        """From a diffusers config.json; None where it asks for something this module does not reproduce."""
        blocks = config.get("down_block_types", ["HunyuanVideoDownBlock3D"] * 4)
        if (config.get("_class_name", CLASS_NAME) != CLASS_NAME
                or config.get("act_fn", "silu") not in SUPPORTED_ACTIVATIONS
                or any(b != "HunyuanVideoDownBlock3D" for b in blocks)
                or config.get("temporal_compression_ratio", 4) != 4):  # diffusers' decoder has no other
            return None
        known = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
        if "block_out_channels" in known:
            known["block_out_channels"] = tuple(known["block_out_channels"])
        settings = cls(**known)
        return settings if len(blocks) == len(settings.block_out_channels) else None


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm; with `channel_sums` (the channels-last form) its statistics are taken per channel first,
    then per group: the same result in fewer passes over NDHWC memory."""

    channel_sums = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.channel_sums:
            return super().forward(x)
        scale, shift = self.scale_and_shift(x)
        return (x.float() * scale + shift).to(x.dtype)

    def silu_padded(self, x: torch.Tensor, padding: tuple[int, ...]) -> torch.Tensor:
        """`F.pad(F.silu(self(x)), padding, mode="replicate")`: in the channels-last form the input is padded,
        then normalised (with the statistics of `x`). The same values, since padding by replication copies
        values and the normalisation and SiLU act on each value alone; but Inductor then reads the padded
        input directly instead of storing the normalised tensor in float32 and padding it in a second kernel
        (it did so after 8 of the encoder's 13 GroupNorms)."""
        if not self.channel_sums:
            return F.pad(F.silu(super().forward(x)), padding, mode="replicate")
        scale, shift = self.scale_and_shift(x)
        return F.silu(F.pad(x, padding, mode="replicate").float() * scale + shift).to(x.dtype)

    def scale_and_shift(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per channel, float32, shaped to broadcast over x: the normalisation is x · scale + shift. With
        `one_pass_norm` each channel's mean and variance come from one read of x (Welford's, in Inductor),
        and a group's variance is its channels' mean variance plus the variance of their means (the law of
        total variance: exact, no difference of large sums); else the mean first, then the spread about it."""
        n, c = x.shape[:2]
        groups, per_group = self.num_groups, c // self.num_groups
        dims = tuple(range(2, x.dim()))
        shape = (n, c) + (1,) * (x.dim() - 2)
        xf = x.float()
        if FAST_PATHS["one_pass_norm"]:
            channel_var, channel_mean = torch.var_mean(xf, dims, correction=0)
            channel_mean = channel_mean.view(n, groups, per_group)
            mean = channel_mean.mean(-1)
            var = (channel_var.view(n, groups, per_group).mean(-1)
                   + (channel_mean - mean.unsqueeze(-1)).square().mean(-1))
        else:
            count = per_group * x[0, 0].numel()
            mean = xf.sum(dims).view(n, groups, per_group).sum(-1).div(count)
            centred = xf - mean.repeat_interleave(per_group, dim=1).view(shape)
            var = centred.square().sum(dims).view(n, groups, per_group).sum(-1).div(count)
        mean_c = mean.repeat_interleave(per_group, dim=1)
        scale = torch.rsqrt(var + self.eps).repeat_interleave(per_group, dim=1)
        if self.affine:
            scale = scale * self.weight.float()
        shift = -mean_c * scale + (self.bias.float() if self.affine else 0)
        return scale.view(shape), shift.view(shape)


class CausalConv3d(nn.Module):
    """A 3-D convolution padded by replication: half the kernel on each side in space, all of it before the
    first frame in time (frame t sees frames ≤ t)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3,
                 stride: int | tuple[int, int, int] = 1) -> None:
        super().__init__()
        k = kernel_size
        self.padding = (k // 2, k // 2, k // 2, k // 2, k - 1, 0)  # W, H, then T (before the first frame)
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride)
        self.register_buffer("taps_weight", None, persistent=False)  # `use_time_taps_as_channels`
        self.register_load_state_dict_post_hook(CausalConv3d._refresh_taps_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(self.padding):
            x = F.pad(x, self.padding, mode="replicate")
        if self.taps_weight is None:
            return self.conv(x)
        n, c, _, h, w = x.shape
        kt = self.conv.kernel_size[0]
        # channel i·c + j: tap i, input j
        windows = x.unfold(2, kt, 1)  # N×C×T×H×W×kt: output frame t's input frames t … t+kt−1
        stacked = windows.permute(0, 5, 1, 2, 3, 4).reshape(n, kt * c, -1, h, w)
        stacked = F.pad(stacked, (0, 0) * 3 + (0, self.taps_weight.shape[1] - kt * c))
        return F.conv3d(stacked, self.taps_weight, self.conv.bias)

    def use_time_taps_as_channels(self) -> None:
        """Run as a convolution over space of the kt time-shifted copies of the input stacked as channels
        (padded with zero channels to a multiple of 8), in channels-last. For the encoder's first
        convolution: with 3 input channels cuDNN's kernels ran it at a tenth of the others' rate (7.7 ms of a
        169 ms call on an H100; 2.3 ms this way, after 0.4 ms to stack). The stacked weight is a buffer,
        made here and again on load_state_dict: derived inside the compiled graph, it left Inductor to choose
        NCDHW for the convolution's output, and the kernels after it paid for the transposes (+13 ms)."""
        if self.conv.stride != (1, 1, 1):
            raise ValueError("time taps as channels: only for a convolution of stride 1")
        self.taps_weight = self._stacked_weight()

    def _stacked_weight(self) -> torch.Tensor:
        w = self.conv.weight.detach()
        out, c, kt, kh, kw = w.shape
        stacked = w.transpose(1, 2).reshape(out, kt * c, 1, kh, kw)  # the channel order of `forward`
        stacked = F.pad(stacked, (0, 0) * 3 + (0, -(kt * c) % 8))
        return stacked.contiguous(memory_format=torch.channels_last_3d)

    @staticmethod
    def _refresh_taps_weight(module: CausalConv3d, _: Any) -> None:
        if module.taps_weight is not None:
            module.taps_weight = module._stacked_weight()

    def after_norm_silu(self, norm: GroupNorm, x: torch.Tensor) -> torch.Tensor:
        """`self(F.silu(norm(x)))`, padded as `GroupNorm.silu_padded` pads."""
        return self.conv(norm.silu_padded(x, self.padding))


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = GroupNorm(groups, in_channels, eps=1e-6)
        self.conv1 = CausalConv3d(in_channels, out_channels)
        self.norm2 = GroupNorm(groups, out_channels, eps=1e-6)
        self.conv2 = CausalConv3d(out_channels, out_channels)
        self.conv_shortcut = (CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels
                              else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1.after_norm_silu(self.norm1, x)
        h = self.conv2.after_norm_silu(self.norm2, h)
        return h + (self.conv_shortcut(x) if self.conv_shortcut is not None else x)


class Downsample(nn.Module):
    def __init__(self, channels: int, stride: tuple[int, int, int]) -> None:
        super().__init__()
        self.conv = CausalConv3d(channels, channels, 3, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class DownBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, layers: int, groups: int,
                 stride: tuple[int, int, int] | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels, groups) for i in range(layers))
        self.downsamplers = nn.ModuleList([Downsample(out_channels, stride)]) if stride else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        for downsampler in self.downsamplers or ():
            x = downsampler(x)
        return x


class Attention(nn.Module):
    """The VAE's single-head self-attention block (GroupNorm, q/k/v, output projection, residual), each
    frame's tokens attending to the tokens of frames ≤ its own."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = GroupNorm(groups, channels, eps=1e-6)
        self.to_q, self.to_k, self.to_v = (nn.Linear(channels, channels) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(channels, channels), nn.Dropout(0.0)])  # diffusers' key names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, t, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # N × THW × C, frame-major
        q, k, v = (proj(tokens) for proj in (self.to_q, self.to_k, self.to_v))  # one head
        hw = h * w
        out = torch.cat([attend(q[:, f * hw:(f + 1) * hw], k[:, :(f + 1) * hw], v[:, :(f + 1) * hw])
                         for f in range(t)], dim=1)
        out = self.to_out[0](out)
        return out.transpose(1, 2).reshape(n, c, t, h, w) + x


# torch.bmm(..., out_dtype=torch.float32) on CUDA: a float32 result from bf16/fp16 inputs (not in every
# torch that setup.cfg allows).
BMM_TO_FLOAT32 = "dtype" in torch.ops.aten.bmm.overloads()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d) v for one head (N × L × d), as two matrix products. The fused attention kernels
    take at most d = 256, and at the VAE's d = 512 PyTorch's memory-efficient kernel took 11 of the H100's
    181 ms a call. The logits stay in float32 (the products accumulate and write float32 for bf16 inputs),
    the softmax too; the probabilities are rounded to the input's type for the second product, as in the
    fused kernels. In half precision where no product writes float32 (a CPU, an older torch): the fused
    kernel."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    if half and not (q.is_cuda and BMM_TO_FLOAT32):
        return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
    logits = (torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32) if half
              else torch.bmm(q, k.transpose(1, 2)))
    probs = logits.mul_(q.shape[-1] ** -0.5).softmax(-1)
    return torch.bmm(probs.to(v.dtype), v)


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups) for _ in range(2)])
        self.attentions = nn.ModuleList([Attention(channels, groups) if attention else None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        if self.attentions[0] is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Encoder3D(nn.Module):
    """diffusers' HunyuanVideoEncoder3D: frames N×3×T×H×W → 2·latent channels at T/4 (1 + 4k → 1 + k), H/8,
    W/8 for the default ratios."""

    def __init__(self, s: EncoderSettings) -> None:
        super().__init__()
        channels = s.block_out_channels
        groups = s.norm_num_groups
        self.conv_in = CausalConv3d(s.in_channels, channels[0])
        spatial_layers = int(math.log2(s.spatial_compression_ratio))
        time_layers = int(math.log2(s.temporal_compression_ratio))
        blocks = []
        for i, out in enumerate(channels):
            final = i == len(channels) - 1
            spatial = i < spatial_layers
            time = i >= len(channels) - 1 - time_layers and not final  # halved in the blocks before the last
            stride = (2 if time else 1, 2 if spatial else 1, 2 if spatial else 1)
            blocks.append(DownBlock(channels[i - 1] if i else channels[0], out, s.layers_per_block, groups,
                                    stride if spatial or time else None))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(channels[-1], groups, s.mid_block_add_attention)
        self.conv_norm_out = GroupNorm(groups, channels[-1], eps=1e-6)
        self.conv_out = CausalConv3d(channels[-1], 2 * s.latent_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out.after_norm_silu(self.conv_norm_out, x)


class HunyuanVideoEncoder(nn.Module):
    """Frames N×3×T×H×W in [−1, 1] → the posterior's mode, N×latent_channels×T'×H/8×W/8 (unscaled): what
    diffusers' `vae.encode(x).latent_dist.mode()` returns, without temporal or spatial tiling."""

    def __init__(self, settings: EncoderSettings) -> None:
        super().__init__()
        self.latent_channels = settings.latent_channels
        self.scaling_factor = settings.scaling_factor
        self.encoder = Encoder3D(settings)
        self.quant_conv = nn.Conv3d(2 * settings.latent_channels, 2 * settings.latent_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_conv(self.encoder(x))[:, : self.latent_channels]  # the mean: the mode of a Gaussian

    def use_channels_last(self) -> None:
        """NDHWC weights, and GroupNorms that sum per channel: the form `Teacher.compile` compiles."""
        for module in self.modules():
            if isinstance(module, GroupNorm):
                module.channel_sums = True
        self.to(memory_format=torch.channels_last_3d)
        self.encoder.conv_in.use_time_taps_as_channels()


def weight_files(folder: Path) -> list[Path] | None:
    """The folder's safetensors files (one, or the shards its index names); None if it has neither."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / WEIGHTS_INDEX).is_file():
        index = json.loads((folder / WEIGHTS_INDEX).read_text())
        return [folder / name for name in sorted(set(index["weight_map"].values()))]
    return None


def load_encoder(folder: str | Path) -> HunyuanVideoEncoder | None:
    """The encoder of the HunyuanVideo VAE saved in a diffusers folder (config.json + safetensors), reading
    only the encoder's weights; None where the folder is in a form this does not read (weights only as a
    pickle, another architecture, renamed parameters): the caller then loads it with diffusers."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    settings = EncoderSettings.from_config(json.loads((folder / "config.json").read_text()))
    files = weight_files(folder)
    if settings is None or files is None:
        return None
    with torch.device("meta"):  # no initialisation: every parameter is replaced by the stored one
        model = HunyuanVideoEncoder(settings)
    state = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names = [k for k in f.keys() if k.startswith(ENCODER_PREFIXES)]  # noqa: SIM118 (not a dict)
                state.update((k, f.get_tensor(k)) for k in names)
        except SafetensorError as err:  # a damaged or truncated file: one line, from the caller
            raise ValueError(f"{file.name}: {err}") from None
    if set(state) != set(model.state_dict()):
        return None
    model.load_state_dict(state, assign=True)
    return model
