"""A student of two convolutions, importable by the process that compiles it aside (tests/test_precompile.py):
frames N×T×3×H×W → one latent frame → the first frame again. Inductor's C++ compiles it in seconds."""

from __future__ import annotations

import torch
from torch import nn


class TinyStudent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 16, 4, stride=4)
        self.dec = nn.ConvTranspose2d(16, 3, 4, stride=4)

    def encode_video(self, x: torch.Tensor) -> torch.Tensor:
        n, t = x.shape[:2]
        return self.enc(x.flatten(0, 1)).unflatten(0, (n, t)).mean(1, keepdim=True)

    def decode_video(self, z: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        return self.dec(z.flatten(0, 1)).unflatten(0, z.shape[:2])
