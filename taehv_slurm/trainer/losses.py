"""The distillation losses: latent MSE against the teacher, pixel reconstruction ×20, PSNR.

`DistillModule` puts the student and its losses in one forward, so every engine wraps a single call.
The frames ↔ latents layout the losses rely on is explained in trainer/teacher.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from taehv_slurm.trainer.shapes import teacher_frame_count
from taehv_slurm.trainer.teacher import to_unit


def psnr(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """PSNR in dB for images in [0, 1] (prediction clamped, as a viewer would see it)."""
    mse = F.mse_loss(prediction.detach().float().clamp(0, 1), target.detach().float())
    return -10.0 * torch.log10(mse.clamp_min(1e-10))


class DistillModule(nn.Module):
    """The student plus its losses in one forward, so every engine (all-reduce, DeepSpeed) wraps a single
    call.

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

    def forward(self, frames: torch.Tensor,
                teacher_latents: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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


def summarize(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of each metric over micro-batches, as Python floats (one device sync)."""
    keys = metrics[0].keys()
    stacked = torch.stack([torch.stack([m[k].float() for k in keys]) for m in metrics]).mean(0)
    return dict(zip(keys, stacked.tolist()))
