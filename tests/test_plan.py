"""The scale plan for any GPU count: effective batch held (split unevenly where it must), engine by
memory, loader by the measured per-worker rates, NCCL by node count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from taehv_slurm.common.config import ConfigError, load_train
from taehv_slurm.common.plan import plan_for, taehv_param_count

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def real():
    return load_train(REPO / "configs/train/taehv.yaml")


def check_split(plan) -> None:
    """Every sample of a step is taken exactly once, shares differ by at most one, micro-batches fit."""
    shares = [plan.share(r) for r in range(plan.world_size)]
    assert sum(shares) == plan.effective_batch
    assert max(shares) - min(shares) <= 1
    starts = [plan.first_sample(r) for r in range(plan.world_size)]
    assert starts == [sum(shares[:r]) for r in range(plan.world_size)]  # consecutive, no gap, no overlap
    for r in range(plan.world_size):
        sizes = plan.microbatch_sizes(r)
        assert sum(sizes) == shares[r] and all(0 <= s <= plan.per_gpu_batch for s in sizes)
        assert len(sizes) <= plan.grad_accum
        assert sizes == sorted(sizes, reverse=True)  # full micro-batches first, the last may be smaller
        if plan.engine.startswith("zero"):
            assert len(sizes) == plan.grad_accum  # DeepSpeed: every rank runs the same number


@pytest.mark.parametrize(("nodes", "gpus", "per_gpu", "accum", "timeout"), [
    (1, 1, 4, 32, 3600),  # per-GPU batch 4 is the fastest on H200 (docs/benchmarks.md)
    (1, 8, 4, 4, 3600),
    (2, 8, 4, 2, 7200),
    (8, 8, 2, 1, 14400),  # 64 GPUs: 2 samples each
])
def test_effective_batch_is_held(real, nodes: int, gpus: int, per_gpu: int, accum: int, timeout: int) -> None:
    plan = plan_for(nodes, gpus, real)
    assert plan.world_size == nodes * gpus
    assert (plan.per_gpu_batch, plan.grad_accum) == (per_gpu, accum)
    check_split(plan)
    assert plan.lr == pytest.approx(1e-4) and plan.warmup_steps == 2000  # same optimisation at any count
    assert plan.nccl_timeout_s == timeout
    # 11 M parameters: plain data parallelism is fastest and fits (measured, docs/benchmarks.md)
    assert plan.engine == "allreduce"
    assert plan.nccl_env["NCCL_BUFFSIZE"] == str((32 if nodes >= 8 else 16) * 2**20)
    assert str(plan.world_size) in plan.table()


def test_every_world_size_up_to_1024(real) -> None:
    for world in range(1, 1025):
        if world <= real.batch.effective:
            plan = plan_for(world, 1, real)
            check_split(plan)
            assert plan.lr == pytest.approx(1e-4) and plan.warmup_steps == 2000
            continue
        with pytest.raises(ConfigError) as err:
            plan_for(world, 1, real)
        message = str(err.value)
        assert "\n" not in message and f"cannot be split over {world} GPUs" in message
        assert ("use at most 128 node(s) × 1 = 128 GPUs" in message
                and f"batch.effective to {world} or more" in message)


def test_3_and_5_nodes_of_8_split_unevenly_with_the_same_lr(real) -> None:
    three = plan_for(3, 8, real)
    assert three.split_text() == "128 = 16 ranks × 5 + 8 ranks × 6; micro-batch ≤ 4, 2 per step"
    assert three.microbatch_sizes(0) == [4, 2] and three.microbatch_sizes(23) == [4, 1]
    assert "16 ranks × 5 + 8 ranks × 6" in three.table()
    five = plan_for(5, 8, real)
    assert five.split_text() == "128 = 32 ranks × 3 + 8 ranks × 4; micro-batch ≤ 4, 1 per step"
    assert three.lr == five.lr == plan_for(1, 8, real).lr
    # memory is estimated for the largest micro-batch
    assert five.memory_per_gpu_gb == plan_for(4, 8, real).memory_per_gpu_gb  # 4 clips in both
    with pytest.raises(ConfigError, match="use at most 16 node"):
        plan_for(17, 8, real)


def test_deepspeed_ranks_with_fewer_samples_pad_to_the_same_count(real) -> None:
    plan = plan_for(26, 1, load_train(real.to_dict(), **{"engine.kind": "zero2"}))  # shares 4 and 5
    assert plan.grad_accum == 2
    assert plan.microbatch_sizes(0) == [4, 1] and plan.microbatch_sizes(25) == [4, 0]  # 0: weight-0 padding
    check_split(plan)
    ddp = plan_for(26, 1, real)
    assert ddp.microbatch_sizes(25) == [4]  # no collectives inside an allreduce micro-step: no padding


def test_1000_gpus(real) -> None:
    with pytest.raises(ConfigError) as err:
        plan_for(125, 8, real)
    assert "over 1000 GPUs" in str(err.value) and "batch.effective to 1000 or more" in str(err.value)
    plan = plan_for(125, 8, load_train(real.to_dict(), **{"batch.effective": 1000}))
    assert (plan.per_gpu_batch, plan.grad_accum, plan.nccl_timeout_s) == (1, 1, 14400)
    assert plan.lr == pytest.approx(1e-4 * (1000 / 128) ** 0.5)  # sqrt rule when the batch itself changes


def test_explicit_accumulation(real) -> None:
    plan = plan_for(1, 8, load_train(real.to_dict(), **{"batch.grad_accum": 2}))
    assert (plan.per_gpu_batch, plan.grad_accum) == (8, 2)  # 8 a GPU × 2 accumulations, as asked
    check_split(plan)
    uneven = plan_for(3, 8, load_train(real.to_dict(), **{"batch.grad_accum": 2}))
    assert uneven.microbatch_sizes(0) == [3, 3] and uneven.microbatch_sizes(23) == [3, 2]
    with pytest.raises(ConfigError, match="set it to at most 16"):
        plan_for(1, 8, load_train(real.to_dict(), **{"batch.grad_accum": 17}))


def test_engine_follows_memory(real) -> None:
    # A model with ~1.3 B parameters: states of 21 GB per GPU under the all-reduce engine do not fit next to
    # activations.
    big = load_train(real.to_dict(), **{"model.decoder_widths": [4096, 4096, 4096, 64], "batch.per_gpu": 1})
    assert taehv_param_count(big) > 1e9
    plan = plan_for(1, 8, big, gpu_memory_gb=30)
    assert plan.engine in ("zero2", "zero3") and "allreduce does not fit" in plan.engine_reason
    with pytest.raises(ConfigError, match="no engine fits"):
        plan_for(1, 8, real, gpu_memory_gb=10)  # 4 clips of 720×480×12 need ~25 GB of activations


def test_zero3_says_it_runs_uncompiled(real) -> None:
    """ZeRO-3 does not compile (its gathered weights cannot be traced through the model's composed ones):
    the plan says so where the config asks for compiling, on GPUs; the other engines compile silently."""
    notes = {kind: plan_for(1, 8, load_train(real.to_dict(), **{"engine.kind": kind})).notes
             for kind in ("allreduce", "zero1", "zero2", "zero3")}
    assert [k for k, lines in notes.items() if any("without torch.compile" in n for n in lines)] == ["zero3"]
    zero3 = load_train(real.to_dict(), **{"engine.kind": "zero3"})
    eager = load_train(zero3.to_dict(), **{"engine.compile": False})
    for quiet in (plan_for(1, 8, eager), plan_for(1, 8, zero3, device="cpu")):
        assert not any("torch.compile" in n for n in quiet.notes)


def test_param_count_matches_the_model(real) -> None:
    from taehv_slurm.trainer.model import TAEHV, TAEHVConfig, param_counts

    assert taehv_param_count(real) == param_counts(TAEHV(TAEHVConfig()))["total"]
    tiny = load_train({"model": {"encoder_width": 16, "decoder_widths": [32, 32, 16, 16]}})
    model = TAEHV(TAEHVConfig(encoder_width=16, decoder_widths=(32, 32, 16, 16)))
    assert taehv_param_count(tiny) == param_counts(model)["total"]


# What a fresh interpreter, started with none of this process's state, plans for 2 nodes × 8 GPUs.
FRESH_PLAN = """
import json, sys
from taehv_slurm.common.config import load_train
from taehv_slurm.common.plan import plan_for
print(json.dumps(plan_for(2, 8, load_train(sys.argv[1])).to_dict()))
"""
# Audit events that would mean the plan touched the world outside its arguments.
OUTSIDE = ("open", "os.listdir", "os.scandir", "os.system", "subprocess.Popen", "socket.connect",
           "socket.getaddrinfo", "shutil.disk_usage")
_audited: list[str] = []
_auditing = threading.local()


def _audit(event: str, args: tuple) -> None:
    if getattr(_auditing, "on", False) and event in OUTSIDE:
        _audited.append(f"{event}{args!r}"[:200])



def test_plan_is_pure_and_cpu_plans_have_no_nccl(real, tmp_path: Path, monkeypatch) -> None:
    """The plan is a function of its arguments only: what another process with another environment and
    folder plans is the same, the config it reads is left as it was, two plans share no mutable part, and
    planning opens no file, starts no process and makes no connection."""
    given = real.to_dict()
    first = plan_for(2, 8, real)
    first.notes.append("changed by a caller")
    first.nccl_env["CHANGED"] = "by a caller"
    for nodes, gpus in ((1, 1), (3, 8), (16, 8)):  # earlier calls leave nothing behind
        plan_for(nodes, gpus, real)
    # The surroundings a plan must not read: a job's launcher variables, visible GPUs, the folder.
    for key, value in {"SLURM_NNODES": "5", "SLURM_CPUS_PER_TASK": "1", "WORLD_SIZE": "7",
                       "CUDA_VISIBLE_DEVICES": "", "LOCAL_WORLD_SIZE": "3", "OMP_NUM_THREADS": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    if not getattr(_audit, "installed", False):  # a hook stays for the process: inert outside `_auditing.on`
        sys.addaudithook(_audit)
        _audit.installed = True  # type: ignore[attr-defined]
    _auditing.on = True
    try:
        again = plan_for(2, 8, real)
    finally:
        _auditing.on = False
    assert _audited == []
    assert real.to_dict() == given
    assert "CHANGED" not in again.nccl_env and "changed by a caller" not in again.notes
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
                 and k not in ("WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")}
    fresh = subprocess.run([sys.executable, "-c", FRESH_PLAN, str(REPO / "configs/train/taehv.yaml")],
                           cwd=REPO, env={**clean_env, "PYTHONPATH": str(REPO)}, capture_output=True,
                           text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout) == json.loads(json.dumps(again.to_dict()))
    cpu = plan_for(2, 2, load_train({"batch": {"effective": 8, "per_gpu": 4}}), device="cpu")
    assert cpu.nccl_env == {} and cpu.precision == "fp32" and cpu.world_size == 4


# Workers that feed one GPU: ⌈55 clips/s (the trainer on an H100/H200) × 1.25 (headroom) / one worker's
# clips/s⌉, with docs/benchmarks.md's per-worker rates at 8 workers: prepared shards 53.7, synthetic 3.75,
# raw H.264 15.2 clips/s. At the shipped 12×480×720 clip: 68.75 / 53.7 → 2, / 3.75 → 19, / 15.2 → 5; at
# 240 rows a clip is half the pixels: 34.4 / 53.7 → 1, / 3.75 → 10, / 15.2 → 3.
@pytest.mark.parametrize(("source", "needed", "needed_at_half"), [("prepared", 2, 1), ("synthetic", 19, 10),
                                                                   ("video", 5, 3)])
def test_loader_workers_come_from_the_measured_rate_and_the_cores(real, source: str, needed: int,
                                                                  needed_at_half: int) -> None:
    cfg = load_train(real.to_dict(), **{"data.source": source, "data.path": "data"})
    half = load_train(cfg.to_dict(), **{"data.height": 240})
    assert plan_for(1, 8, half, cpus_per_task=64).num_workers == needed_at_half
    roomy = plan_for(1, 8, cfg, cpus_per_task=needed + 1)
    assert roomy.num_workers == needed and roomy.notes == []  # one core drives the GPU, the rest load
    tight = plan_for(1, 8, cfg, cpus_per_task=needed)
    assert tight.num_workers == needed - 1
    assert len(tight.notes) == 1 and f"needs ≈{needed + 1} CPU cores per GPU" in tight.notes[0]
    assert "note" in tight.table()
    asked = plan_for(1, 8, load_train(cfg.to_dict(), **{"data.num_workers": 3}), cpus_per_task=2)
    assert asked.num_workers == 3 and asked.notes == []  # an explicit choice is the user's


def test_shipped_config_is_not_loader_bound_with_12_cores_per_gpu(real) -> None:
    plan = plan_for(1, 8, real, cpus_per_task=12)  # configs/cluster/h100_8gpu.yaml
    assert plan.notes == [] and plan.num_workers >= 1


def test_the_plan_prints_only_engine_figures_measured_with_this_model(real) -> None:
    """The engine comparison the plan prints is the kept measurement docs/benchmarks.md cites (clips/s per
    GPU of all-reduce and ZeRO-2, an eager step on one H200), and nothing for an engine without one."""
    rows = json.loads((REPO / "bench/results/engines_h200_2026-11-23_11f044c.json").read_text())["rows"]
    rate = {r["engine"]: r["clips_per_s_per_gpu"] for r in rows}
    reason = plan_for(2, 8, real).engine_reason
    assert reason.endswith(f"zero2 {100 * (rate['zero2'] / rate['ddp'] - 1):+.0f} %"), reason
    assert "zero1" not in reason and "zero3" not in reason


def test_ckpt_every_auto_saves_at_the_interval_that_loses_least(real) -> None:
    """`intervals.ckpt_every: auto` (the shipped config). A save costs its time; an interruption costs the
    work since the last save, half an interval on average; so per second of training the run loses
    save_s / interval + interval / (2 × the job's mean time between interruptions). The plan's interval is
    the one that loses least, at most an hour, found here by searching that loss, from the figures the plan
    cites: Llama 3's 466 interruptions in 54 days on 16,384 GPUs, a save of 0.5 s on one H100, and a step
    at 55 clips/s per GPU."""
    assert real.intervals.ckpt_every == "auto"
    per_gpu_s = 54 * 86400 * 16384 / 466  # GPU-seconds between interruptions
    save_s, cap_s = 0.5, 3600.0
    big = load_train(real.to_dict(), **{"batch.effective": 16384})
    for gpus in (8, 64, 512, 4096, 16384):
        between_s = per_gpu_s / gpus

        def lost(interval: float, between_s: float = between_s) -> float:
            return save_s / interval + interval / (2 * between_s)

        low, high = 1.0, cap_s  # the loss falls, then rises: narrow down on its lowest point
        for _ in range(200):
            a, b = low + (high - low) / 3, high - (high - low) / 3
            low, high = (low, b) if lost(a) < lost(b) else (a, high)
        best = (low + high) / 2
        plan = plan_for(gpus // 8, 8, big)
        assert plan.ckpt_interval_s == pytest.approx(best, rel=1e-6), gpus
        step_s = 16384 / (gpus * 55.0)  # the shipped clip is the reference clip
        assert plan.ckpt_every == max(1, round(best / step_s)), gpus
        assert "ckpt auto: ≈" in plan.table()
    fixed = plan_for(1, 8, load_train(real.to_dict(), **{"intervals.ckpt_every": 500}))
    assert (fixed.ckpt_every, fixed.ckpt_interval_s) == (500, None)
