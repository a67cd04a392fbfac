"""Distillation targets and losses.

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

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TIME_FACTOR = 4


def teacher_frame_count(frames: int) -> int:
    """How many leading frames of a 4L-frame window the 1 + 4k teacher encodes into L latents."""
    if frames % TIME_FACTOR:
        raise ValueError(f"clip length {frames} is not a multiple of {TIME_FACTOR}")
    return frames - (TIME_FACTOR - 1)


def to_unit(frames: torch.Tensor) -> torch.Tensor:
    """uint8 N×T×3×H×W → float in [0, 1] (on the frames' device)."""
    return frames.float().div_(255.0) if frames.dtype == torch.uint8 else frames.float()


def psnr(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """PSNR in dB for images in [0, 1] (prediction clamped, as a viewer would see it)."""
    mse = F.mse_loss(prediction.detach().float().clamp(0, 1), target.detach().float())
    return -10.0 * torch.log10(mse.clamp_min(1e-10))


class Teacher:
    """A frozen diffusers video VAE that turns clips into TAEHV-layout target latents."""

    def __init__(self, vae: nn.Module, scaling_factor: float | None = None) -> None:
        self.vae = vae.eval().requires_grad_(False)
        self.scaling_factor = float(scaling_factor if scaling_factor is not None else vae.config.scaling_factor)
        if hasattr(self.vae, "disable_tiling"):
            self.vae.disable_tiling()  # one pass per clip: targets must not depend on tile seams

    def to(self, device: torch.device, dtype: torch.dtype) -> Teacher:
        self.vae.to(device=device)
        if next(self.vae.parameters()).dtype != dtype:  # diffusers warns on any dtype argument
            self.vae.to(dtype=dtype)
        return self

    @torch.no_grad()
    def latents(self, frames: torch.Tensor) -> torch.Tensor:
        """frames: N×4L×3×H×W in [0, 1] (or uint8) → N×L×C×H/8×W/8 scaled latents."""
        x = to_unit(frames)[:, : teacher_frame_count(frames.shape[1])]
        param = next(self.vae.parameters())
        x = x.to(device=param.device, dtype=param.dtype).mul(2).sub(1).permute(0, 2, 1, 3, 4)  # N×C×T×H×W in [-1, 1]
        z = self.vae.encode(x).latent_dist.mode() * self.scaling_factor
        return z.permute(0, 2, 1, 3, 4).float().contiguous()


def load_teacher(kind: str, path: str, scaling_factor: float | None = None, seed: int = 0) -> Teacher:
    """A teacher from a local diffusers folder (no hub download), or `random:tiny` for tests and demos."""
    import diffusers

    classes = {"hunyuanvideo": "AutoencoderKLHunyuanVideo", "cogvideox": "AutoencoderKLCogVideoX", "wan": "AutoencoderKLWan"}
    if kind not in classes:
        raise ValueError(f"teacher.kind {kind!r} is not one of {', '.join(classes)}")
    cls = getattr(diffusers, classes[kind])
    if path.startswith("random:"):
        if kind != "hunyuanvideo" or path != "random:tiny":
            raise ValueError(f"teacher.path {path!r}: only 'random:tiny' with kind hunyuanvideo is built in")
        with torch.random.fork_rng(devices=[]):  # every rank builds the same weights; global RNG untouched
            torch.manual_seed(seed)
            vae = cls(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=16)
        return Teacher(vae, scaling_factor)
    try:
        vae = cls.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0]
        raise FileNotFoundError(f"teacher.path {path}: cannot load a {classes[kind]} from it ({first}); "
                                "point it at a local diffusers VAE folder (config.json + weights)") from None
    return Teacher(vae, scaling_factor)


class DistillModule(nn.Module):
    """The student plus its losses in one forward, so DDP and DeepSpeed wrap a single call.

    forward(frames, teacher_latents) → (loss, metrics). Pixel losses use the decoder output BEFORE
    clamping (a clamp would zero the gradients of out-of-range pixels).
    """

    def __init__(self, student: nn.Module, latent_weight: float = 1.0, reconstruction_weight: float = 20.0,
                 decoder_weight: float = 0.0) -> None:
        super().__init__()
        self.student = student
        self.latent_weight = latent_weight
        self.reconstruction_weight = reconstruction_weight
        self.decoder_weight = decoder_weight
        self.compute_dtype: torch.dtype | None = None  # bf16 when the engine keeps bf16 weights (DeepSpeed)

    def forward(self, frames: torch.Tensor, teacher_latents: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = to_unit(frames)
        target = x[:, : teacher_frame_count(x.shape[1])]
        latents = self.student.encode_video(x if self.compute_dtype is None else x.to(self.compute_dtype))
        decoded = self.student.decode_video(latents, clamp=False)
        reconstruction = F.mse_loss(decoded.float(), target)
        loss = self.reconstruction_weight * reconstruction
        metrics = {"reconstruction_loss": reconstruction.detach(), "psnr": psnr(decoded, target)}
        if teacher_latents is not None and self.latent_weight:
            latent = F.mse_loss(latents.float(), teacher_latents.float())
            loss = loss + self.latent_weight * latent
            metrics["latent_loss"] = latent.detach()
        if teacher_latents is not None and self.decoder_weight:
            from_teacher = self.student.decode_video(teacher_latents.to(latents.dtype), clamp=False)
            decoder = F.mse_loss(from_teacher.float(), target)
            loss = loss + self.decoder_weight * decoder
            metrics["decoder_loss"] = decoder.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to base_lr, then cosine decay to base_lr × min_lr_ratio at total_steps.

    A pure function of the step: the schedule's whole state is the step, saved with the checkpoint.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def summarize(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of each metric over micro-batches, as Python floats (one device sync)."""
    keys = metrics[0].keys()
    stacked = torch.stack([torch.stack([m[k].float() for k in keys]) for m in metrics]).mean(0)
    return dict(zip(keys, stacked.tolist()))
