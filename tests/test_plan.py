"""The scale plan for any GPU count: effective batch held, engine by memory, NCCL by node count."""

from __future__ import annotations

import pytest

from taehv_slurm.config import ConfigError, load_train
from taehv_slurm.plan import plan_for, taehv_param_count, valid_gpu_counts


@pytest.fixture(scope="module")
def real():
    from pathlib import Path

    return load_train(Path(__file__).resolve().parents[1] / "configs/train/taehv.yaml")


@pytest.mark.parametrize(("nodes", "gpus", "per_gpu", "accum", "timeout"), [
    (1, 1, 4, 32, 3600),  # per-GPU batch 4 is the fastest on H200 (docs/benchmarks.md)
    (1, 8, 4, 4, 3600),
    (2, 8, 4, 2, 7200),
    (8, 8, 2, 1, 14400),  # 64 GPUs: per-GPU batch drops to 2
])
def test_effective_batch_is_held(real, nodes: int, gpus: int, per_gpu: int, accum: int, timeout: int) -> None:
    plan = plan_for(nodes, gpus, real)
    assert plan.world_size == nodes * gpus
    assert (plan.per_gpu_batch, plan.grad_accum) == (per_gpu, accum)
    assert plan.per_gpu_batch * plan.world_size * plan.grad_accum == plan.effective_batch == 128
    assert plan.lr == pytest.approx(1e-4) and plan.warmup_steps == 2000  # same optimisation at any count
    assert plan.nccl_timeout_s == timeout
    assert plan.engine == "ddp"  # 11 M parameters: DDP is fastest and fits (measured, docs/benchmarks.md)
    assert plan.nccl_env["NCCL_BUFFSIZE"] == str((32 if nodes >= 8 else 16) * 2**20)
    assert str(plan.world_size) in plan.table()


def test_24_gpus_names_the_nearest_valid_counts(real) -> None:
    with pytest.raises(ConfigError) as err:
        plan_for(3, 8, real)
    message = str(err.value)
    assert "\n" not in message
    assert "cannot be split evenly over 24 GPUs" in message
    assert "use 16 or 32 GPUs" in message and "batch.effective to 120 or 144" in message


def test_1000_gpus(real) -> None:
    with pytest.raises(ConfigError) as err:
        plan_for(125, 8, real)
    assert "over 1000 GPUs" in str(err.value) and "batch.effective to 1000" in str(err.value)
    plan = plan_for(125, 8, load_train(real.to_dict(), **{"batch.effective": 1000}))
    assert (plan.per_gpu_batch, plan.grad_accum, plan.nccl_timeout_s) == (1, 1, 14400)
    assert plan.lr == pytest.approx(1e-4 * (1000 / 128) ** 0.5)  # sqrt rule when the batch itself changes


def test_explicit_accumulation(real) -> None:
    plan = plan_for(1, 8, load_train(real.to_dict(), **{"batch.grad_accum": 2}))
    assert (plan.per_gpu_batch, plan.grad_accum) == (8, 2)  # the guides' 8-GPU split, asked for explicitly
    with pytest.raises(ConfigError, match="does not divide"):
        plan_for(1, 8, load_train(real.to_dict(), **{"batch.grad_accum": 3}))


def test_engine_follows_memory(real) -> None:
    # A model with ~1.3 B parameters: states of 21 GB per GPU under DDP do not fit next to activations.
    big = load_train(real.to_dict(), **{"model.decoder_widths": [4096, 4096, 4096, 64], "batch.per_gpu": 1})
    assert taehv_param_count(big) > 1e9
    plan = plan_for(1, 8, big, gpu_memory_gb=30)
    assert plan.engine in ("zero2", "zero3") and "ddp does not fit" in plan.engine_reason
    with pytest.raises(ConfigError, match="no engine fits"):
        plan_for(1, 8, real, gpu_memory_gb=10)  # 4 clips of 720×480×12 need ~25 GB of activations


def test_valid_gpu_counts() -> None:
    assert valid_gpu_counts(128, 24, 8) == [16, 32]
    assert valid_gpu_counts(128, 1000) == [64, 128]


def test_param_count_matches_the_model(real) -> None:
    from trainer.model import TAEHV, TAEHVConfig, param_counts

    assert taehv_param_count(real) == param_counts(TAEHV(TAEHVConfig()))["total"]
    tiny = load_train({"model": {"encoder_width": 16, "decoder_widths": [32, 32, 16, 16]}})
    model = TAEHV(TAEHVConfig(encoder_width=16, decoder_widths=(32, 32, 16, 16)))
    assert taehv_param_count(tiny) == param_counts(model)["total"]


def test_plan_is_pure_and_cpu_plans_have_no_nccl(real) -> None:
    assert plan_for(2, 8, real) == plan_for(2, 8, real)
    cpu = plan_for(2, 2, load_train({"batch": {"effective": 8, "per_gpu": 4}}), device="cpu")
    assert cpu.nccl_env == {} and cpu.precision == "fp32" and cpu.world_size == 4


def test_raw_video_that_cannot_keep_up_is_flagged(real) -> None:
    video = load_train(real.to_dict(), **{"data.source": "video", "data.path": "videos"})
    plan = plan_for(1, 8, video, cpus_per_task=2)  # a 16-core node with 8 GPUs
    assert plan.notes and "≈9 CPU cores per GPU" in plan.notes[0] and "jobs.prepare" in plan.notes[0]
    assert "note" in plan.table()
    assert plan_for(1, 8, video, cpus_per_task=12).notes == []  # 12 cores per GPU decode fast enough
    assert plan_for(1, 8, real, cpus_per_task=2).notes == []  # prepared shards: nothing to flag
