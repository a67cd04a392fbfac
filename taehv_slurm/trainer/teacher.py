"""The teacher: a frozen video VAE encoder whose latents the student learns to produce.

Frames ↔ latents, made explicit (and tested):
- A training window has T = 4L frames. TAEHV encodes all 4L frames into L latents (latent j has seen
  frames up to 4j+3) and decodes L latents into 4L−3 frames that correspond to input frames 0..4L−4.
- HunyuanVideo's causal VAE maps 1 + 4k frames to 1 + k latents (the first frame alone). Given the
  first 4L−3 frames of the window it also gives L latents (latent j has seen frames up to 4j).
- So the teacher sees exactly the frames the student's decoder must reproduce: frames[:4L−3].
CogVideoX's and Wan's VAEs follow the same 1 + 4k layout.

Teacher latents are the latents the diffusion model sees: `latent_dist.mode()` × the VAE's
scaling_factor (0.476986 for HunyuanVideo), in TAEHV's N×L×C×h×w layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from taehv_slurm.common.messages import first_line
from taehv_slurm.trainer.hunyuan_encoder import CLASS_NAME, EncoderSettings, HunyuanVideoEncoder, load_encoder
from taehv_slurm.trainer.shapes import teacher_frame_count


def to_unit(frames: torch.Tensor) -> torch.Tensor:
    """uint8 N×T×3×H×W → float in [0, 1] (on the frames' device)."""
    return frames.float().div_(255.0) if frames.dtype == torch.uint8 else frames.float()


class DiffusersEncoder(nn.Module):
    """A diffusers video VAE's encode as a module: frames N×3×T×H×W → the posterior's mode (unscaled)."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae
        self.latent_channels = int(vae.config.latent_channels)
        self.scaling_factor = float(vae.config.scaling_factor)
        if hasattr(vae, "disable_tiling"):
            vae.disable_tiling()  # one pass per clip: targets must not depend on tile seams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(x).latent_dist.mode()

    def compile(self, *args: Any, **kwargs: Any) -> None:
        self.vae.encoder.compile(*args, **kwargs)  # diffusers' encode around it does not trace as one graph


class Teacher:
    """A frozen video VAE encoder that turns clips into TAEHV-layout target latents.

    encoder: frames N×3×T×H×W in [−1, 1] → the posterior's mode; it names its `latent_channels` and
    `scaling_factor` (HunyuanVideoEncoder, or DiffusersEncoder around any diffusers VAE)."""

    def __init__(self, encoder: nn.Module, scaling_factor: float | None = None) -> None:
        self.encoder = encoder.eval().requires_grad_(False)
        self.latent_channels = int(encoder.latent_channels)
        self.scaling_factor = float(scaling_factor if scaling_factor is not None else encoder.scaling_factor)
        self.channels_last = False

    def to(self, device: torch.device, dtype: torch.dtype) -> Teacher:
        """On `device` in `dtype`."""
        self.encoder.to(device=device, dtype=dtype)
        return self

    def use_channels_last(self) -> None:
        """HunyuanVideo's encoder in the form `compile` compiles (`HunyuanVideoEncoder.use_channels_last`)."""
        self.encoder.use_channels_last()
        self.channels_last = True

    def compile(self) -> None:
        """torch.compile the encoder (static shapes) in the form that compiles fastest: for HunyuanVideo,
        channels-last (1.37× on an H100)."""
        if hasattr(self.encoder, "use_channels_last"):
            self.use_channels_last()
        self.encoder.compile(dynamic=False)

    @torch.no_grad()
    def latents(self, frames: torch.Tensor) -> torch.Tensor:
        """frames: N×4L×3×H×W in [0, 1] (or uint8) → N×L×C×H/8×W/8 scaled latents."""
        x = to_unit(frames)[:, : teacher_frame_count(frames.shape[1])]
        param = next(self.encoder.parameters())
        # N×C×T×H×W in [-1, 1]
        x = x.to(device=param.device, dtype=param.dtype).mul(2).sub(1).permute(0, 2, 1, 3, 4)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        z = self.encoder(x) * self.scaling_factor
        return z.permute(0, 2, 1, 3, 4).float().contiguous()


TINY = EncoderSettings(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4)  # random:tiny


def load_teacher(kind: str, path: str, scaling_factor: float | None = None, seed: int = 0) -> Teacher:
    """A teacher from a local diffusers folder (no hub download), or `random:tiny` for tests and demos.

    HunyuanVideo's encoder is read by `hunyuan_encoder` without importing diffusers (9–10 s a rank); other
    kinds, and a HunyuanVideo folder in a form it does not read, load through diffusers."""
    classes = {"hunyuanvideo": CLASS_NAME, "cogvideox": "AutoencoderKLCogVideoX",
               "wan": "AutoencoderKLWan"}
    if kind not in classes:
        raise ValueError(f"teacher.kind {kind!r} is not one of {', '.join(classes)}")
    if path.startswith("random:"):
        if kind != "hunyuanvideo" or path != "random:tiny":
            raise ValueError(f"teacher.path {path!r}: only 'random:tiny' with kind hunyuanvideo is built in")
        with torch.random.fork_rng(devices=[]):  # every rank builds the same weights; global RNG untouched
            torch.manual_seed(seed)
            return Teacher(HunyuanVideoEncoder(TINY), scaling_factor)
    try:
        encoder = load_encoder(path) if kind == "hunyuanvideo" else None
        if encoder is None:
            try:
                import diffusers
            except ImportError:
                raise ImportError(f"teacher {kind} {path}: loading a {classes[kind]} needs diffusers; "
                                  "pip install 'taehv-slurm[teacher]'") from None
            vae = getattr(diffusers, classes[kind]).from_pretrained(path, local_files_only=True,
                                                                    torch_dtype=torch.float32)
            encoder = DiffusersEncoder(vae)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"teacher.path {path}: cannot load a {classes[kind]} from it "
                                f"({first_line(err)}); "
                                "point it at a local diffusers VAE folder (config.json + weights)") from None
    return Teacher(encoder, scaling_factor)
