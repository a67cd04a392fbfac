"""The teacher's own HunyuanVideo encoder (taehv_slurm/trainer/hunyuan_encoder.py) gives diffusers' latents
from diffusers' files, without importing diffusers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLHunyuanVideo
from torch import nn

from taehv_slurm.trainer.hunyuan_encoder import (
    ENCODER_PREFIXES,
    EncoderSettings,
    GroupNorm,
    HunyuanVideoEncoder,
    attend,
)
from taehv_slurm.trainer.layers import FAST_PATHS
from taehv_slurm.trainer.teacher import DiffusersEncoder, load_teacher
from tests.helpers import REPO

TINY = {"block_out_channels": (8, 16, 16, 32), "layers_per_block": 1, "norm_num_groups": 4,
        "latent_channels": 16}


def diffusers_latents(vae: nn.Module, frames: torch.Tensor, scaling_factor: float) -> torch.Tensor:
    """diffusers' encoder as published, on the frames the teacher sees (N×T×3×H×W uint8)."""
    x = frames[:, :13].float().div(255).mul(2).sub(1).permute(0, 2, 1, 3, 4)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode() * scaling_factor
    return z.permute(0, 2, 1, 3, 4)


def saved_vae(folder: Path, **config: object) -> AutoencoderKLHunyuanVideo:
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(**config).eval()
    vae.save_pretrained(str(folder))
    return vae


@pytest.mark.parametrize("config", [TINY, {**TINY, "layers_per_block": 2, "mid_block_add_attention": False}],
                         ids=["tiny", "no-attention"])
def test_the_teachers_encoder_gives_diffusers_latents_from_diffusers_files(tmp_path: Path, config) -> None:
    reference = saved_vae(tmp_path / "vae", **config)
    frames = torch.randint(0, 256, (2, 16, 3, 48, 40), dtype=torch.uint8)  # 13 frames seen
    expected = diffusers_latents(reference, frames, reference.config.scaling_factor)
    assert expected.shape[1] == 4  # latent frames

    teacher = load_teacher("hunyuanvideo", str(tmp_path / "vae"))
    assert type(teacher.encoder) is HunyuanVideoEncoder  # read without diffusers
    assert teacher.scaling_factor == reference.config.scaling_factor
    torch.testing.assert_close(teacher.latents(frames), expected, rtol=1e-5, atol=1e-5)

    # What Teacher.compile() compiles: channels-last, GroupNorms that sum per channel.
    teacher.use_channels_last()
    assert all(m.channel_sums for m in teacher.encoder.modules() if isinstance(m, GroupNorm))
    torch.testing.assert_close(teacher.latents(frames), expected, rtol=1e-5, atol=1e-5)


def test_the_frame_causal_attention_is_what_makes_the_latents_match(tmp_path: Path) -> None:
    """Attending to every frame (diffusers' attention without its causal mask) gives other latents: the
    comparison above can fail on the attention."""
    reference = saved_vae(tmp_path / "vae", **TINY)
    frames = torch.randint(0, 256, (2, 16, 3, 48, 40), dtype=torch.uint8)
    expected = diffusers_latents(reference, frames, 1.0)
    teacher = load_teacher("hunyuanvideo", str(tmp_path / "vae"), scaling_factor=1.0)
    attention = teacher.encoder.encoder.mid_block.attentions[0]
    causal = attention.forward

    def every_frame(x: torch.Tensor) -> torch.Tensor:  # t frames at once: each sees all of them
        n, c, t, h, w = x.shape
        return causal(x.transpose(2, 3).reshape(n, c, 1, t * h, w)).reshape(n, c, h, t, w).transpose(2, 3)

    attention.forward = every_frame
    assert not torch.allclose(teacher.latents(frames), expected, atol=1e-3)


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_sum_group_norm_is_group_norm(dtype: torch.dtype, one_pass: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of the statistics (`one_pass_norm` on and off) give nn.GroupNorm's result; the channels of
    a group have other means (a group's variance is not only its channels' variances)."""
    monkeypatch.setitem(FAST_PATHS, "one_pass_norm", one_pass)
    torch.manual_seed(0)
    native = nn.GroupNorm(4, 16, eps=1e-6)
    nn.init.normal_(native.weight)
    nn.init.normal_(native.bias)
    fast = GroupNorm(4, 16, eps=1e-6)
    fast.channel_sums = True
    fast.load_state_dict(native.state_dict())
    offset = 50 + 4 * torch.arange(16.0).view(1, 16, 1, 1, 1)  # far above the spread, other in each channel
    x = (torch.randn(2, 16, 3, 8, 8) * 3 + offset).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        want = native.to(dtype)(x.contiguous()).float()
        got = fast.to(dtype)(x).float()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_the_channels_last_form_follows_weights_loaded_after_it() -> None:
    """`use_channels_last` runs the first convolution from a stacked copy of its weight; weights loaded
    afterwards (load_state_dict) must be the ones it computes with."""
    settings = EncoderSettings(**TINY)
    torch.manual_seed(0)
    channels_last = HunyuanVideoEncoder(settings).eval()
    channels_last.use_channels_last()
    other = HunyuanVideoEncoder(settings).eval()  # other random weights
    channels_last.load_state_dict(other.state_dict())
    x = torch.rand(2, 3, 13, 48, 40) * 2 - 1
    with torch.no_grad():
        got = channels_last(x.contiguous(memory_format=torch.channels_last_3d))
        torch.testing.assert_close(got, other(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_as_matrix_products_is_the_fused_attention(dtype: torch.dtype) -> None:
    """`attend` (float32: two products and a softmax; bf16 on a CPU: the fused kernel) against PyTorch's
    attention, queries fewer than keys as in the frame-causal mid-block."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 64), torch.randn(2, 18, 64), torch.randn(2, 18, 64)
    want = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
    got = attend(q.to(dtype), k.to(dtype), v.to(dtype)).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_the_default_architecture_has_diffusers_encoder_parameters() -> None:
    """Names and shapes of every encoder parameter of the published default config (HunyuanVideo's VAE)."""
    with torch.device("meta"):
        published = AutoencoderKLHunyuanVideo()
        ours = HunyuanVideoEncoder(EncoderSettings())
    want = {k: v.shape for k, v in published.state_dict().items() if k.startswith(ENCODER_PREFIXES)}
    assert {k: v.shape for k, v in ours.state_dict().items()} == want


def test_a_folder_this_does_not_read_loads_through_diffusers(tmp_path: Path) -> None:
    """Weights as a pickle only: diffusers reads it, and the latents are the same."""
    reference = AutoencoderKLHunyuanVideo(**TINY).eval()
    reference.save_pretrained(str(tmp_path / "vae"), safe_serialization=False)
    teacher = load_teacher("hunyuanvideo", str(tmp_path / "vae"))
    assert type(teacher.encoder) is DiffusersEncoder
    frames = torch.randint(0, 256, (1, 8, 3, 32, 32), dtype=torch.uint8)
    x = frames[:, :5].float().div(255).mul(2).sub(1).permute(0, 2, 1, 3, 4)
    with torch.no_grad():
        want = reference.encode(x).latent_dist.mode() * reference.config.scaling_factor
    torch.testing.assert_close(teacher.latents(frames), want.permute(0, 2, 1, 3, 4), rtol=1e-5, atol=1e-5)


def test_a_hunyuan_teacher_loads_without_importing_diffusers(tmp_path: Path) -> None:
    saved_vae(tmp_path / "vae", **TINY)
    code = ("import sys; from taehv_slurm.trainer.teacher import load_teacher; "
            f"t = load_teacher('hunyuanvideo', {str(tmp_path / 'vae')!r}); "
            "load_teacher('hunyuanvideo', 'random:tiny'); "
            "print(type(t.encoder).__name__, sorted(m for m in sys.modules if m.startswith('diffusers')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["HunyuanVideoEncoder", "[]"]


def test_a_damaged_weights_file_is_one_line_naming_the_folder(tmp_path: Path) -> None:
    saved_vae(tmp_path / "vae", **TINY)
    weights = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    damaged = r"teacher.path .*vae: cannot load a AutoencoderKLHunyuanVideo .*diffusion_pytorch_model"
    with pytest.raises(FileNotFoundError, match=damaged):
        load_teacher("hunyuanvideo", str(tmp_path / "vae"))
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderKLHunyuanVideo"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_teacher_gives_the_published_encoders_latents_on_a_gpu(tmp_path: Path) -> None:
    """What `jobs.prepare` runs (Teacher.compile: channels-last, Inductor) against diffusers' eager encoder,
    both in bf16, HunyuanVideo's default architecture read from a diffusers folder. At 13×480×720 the two
    differed by 1.4 % of the largest latent when the encoder was rewritten, compiling diffusers' encoder
    unchanged by 2.5 % (one H100)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLHunyuanVideo()
    vae.save_pretrained(str(tmp_path / "vae"))
    vae.to(torch.bfloat16)
    frames = torch.randint(0, 256, (2, 16, 3, 96, 128), dtype=torch.uint8, device=device)
    with torch.no_grad():
        x = frames[:, :13].float().div(255).to(torch.bfloat16).mul(2).sub(1).permute(0, 2, 1, 3, 4)
        want = (vae.encode(x).latent_dist.mode() * vae.config.scaling_factor).permute(0, 2, 1, 3, 4).float()
    teacher = load_teacher("hunyuanvideo", str(tmp_path / "vae")).to(device, torch.bfloat16)
    teacher.compile()
    got = teacher.latents(frames)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.05 * scale and (got - want).abs().mean() <= 0.005 * scale
