"""The teacher's faster encoder (taehv_slurm/trainer/teacher_fast.py) gives diffusers' own latents."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo
from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import prepare_causal_attention_mask
from torch import nn

from taehv_slurm.trainer.teacher import Teacher, load_teacher
from taehv_slurm.trainer.teacher_fast import (
    ChannelSumGroupNorm,
    FrameCausalMidBlock3D,
    frame_causal_attention,
)

TINY = {"block_out_channels": (8, 16, 16, 32), "layers_per_block": 1, "norm_num_groups": 4,
        "latent_channels": 16}


def diffusers_latents(vae: nn.Module, frames: torch.Tensor, scaling_factor: float) -> torch.Tensor:
    """diffusers' encoder as published, on the frames the teacher sees (N×T×3×H×W uint8)."""
    x = frames[:, :13].float().div(255).mul(2).sub(1).permute(0, 2, 1, 3, 4)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode() * scaling_factor
    return z.permute(0, 2, 1, 3, 4)


def test_the_fast_encoder_gives_diffusers_latents() -> None:
    torch.manual_seed(0)
    reference = AutoencoderKLHunyuanVideo(**TINY).eval()
    published = {k: v.clone() for k, v in reference.state_dict().items()}
    frames = torch.randint(0, 256, (2, 16, 3, 48, 40), dtype=torch.uint8)  # 13 frames seen: 4 latent frames
    expected = diffusers_latents(reference, frames, 0.5)

    vae = AutoencoderKLHunyuanVideo(**TINY)
    vae.load_state_dict(published)
    teacher = Teacher(vae, 0.5)
    assert type(vae.encoder.mid_block) is FrameCausalMidBlock3D  # the mask-free attention is in use
    torch.testing.assert_close(teacher.latents(frames), expected, rtol=1e-5, atol=1e-5)

    # What Teacher.compile() compiles: channels-last with per-channel-sum GroupNorms.
    teacher.use_channels_last()
    swapped = [type(m) for m in vae.encoder.modules()]
    assert ChannelSumGroupNorm in swapped
    assert nn.GroupNorm not in swapped and set(vae.state_dict()) == set(published)  # same weights, same keys
    torch.testing.assert_close(teacher.latents(frames), expected, rtol=1e-5, atol=1e-5)



def test_frame_causal_attention_is_diffusers_masked_attention() -> None:
    torch.manual_seed(0)
    attn = AutoencoderKLHunyuanVideo(**TINY).encoder.mid_block.attentions[0]
    n, c, t, h, w = 2, 32, 4, 3, 5
    x = torch.randn(n, c, t, h, w)
    tokens = x.permute(0, 2, 3, 4, 1).flatten(1, 3)  # as diffusers' mid-block calls it
    mask = prepare_causal_attention_mask(t, h * w, x.dtype, x.device, batch_size=n)
    with torch.no_grad():
        want = attn(tokens, attention_mask=mask).unflatten(1, (t, h, w)).permute(0, 4, 1, 2, 3)
        unmasked = attn(tokens).unflatten(1, (t, h, w)).permute(0, 4, 1, 2, 3)
        got = frame_causal_attention(attn, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, unmasked, atol=1e-3)  # the mask matters here: the check above can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_sum_group_norm_is_group_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    native = nn.GroupNorm(4, 16, eps=1e-6)
    nn.init.normal_(native.weight)
    nn.init.normal_(native.bias)
    fast = ChannelSumGroupNorm(4, 16, eps=1e-6)
    fast.load_state_dict(native.state_dict())
    x = (torch.randn(2, 16, 3, 8, 8) * 3 + 50).to(dtype)  # offset far above the spread: tests the variance
    x = x.contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        want = native.to(dtype)(x.contiguous()).float()
        got = fast.to(dtype)(x).float()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_random_tiny_teacher_is_built_with_the_fast_attention() -> None:
    teacher = load_teacher("hunyuanvideo", "random:tiny")
    assert type(teacher.vae.encoder.mid_block) is FrameCausalMidBlock3D


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_teacher_gives_the_published_encoders_latents_on_a_gpu() -> None:
    """What `jobs.prepare` runs (Teacher.compile: channels-last, Inductor) against diffusers' eager encoder,
    both in bf16, HunyuanVideo's default architecture. At 13×480×720 the two differ by 1.4 % of the
    largest latent, compiling diffusers' encoder unchanged by 2.5 % (docs/benchmarks.md)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLHunyuanVideo().to(torch.bfloat16)
    frames = torch.randint(0, 256, (2, 16, 3, 96, 128), dtype=torch.uint8, device=device)
    with torch.no_grad():
        x = frames[:, :13].float().div(255).to(torch.bfloat16).mul(2).sub(1).permute(0, 2, 1, 3, 4)
        want = (vae.encode(x).latent_dist.mode() * vae.config.scaling_factor).permute(0, 2, 1, 3, 4).float()
    teacher = Teacher(vae).to(device, torch.bfloat16)
    teacher.compile()
    got = teacher.latents(frames)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.05 * scale and (got - want).abs().mean() <= 0.005 * scale
