"""Any GPU count, the same training (the Slurm testbed: CPU, gloo, one real process per rank).

The tiny config without its teacher, at 32×32 (`quick_train`: what is compared is the split, the reduction
and the resume, which the teacher's latents do not touch), with effective batch 8 in micro-batches of at
most 2: world sizes 1, 2, 3 and 5 train the same 5 steps on the same clips, for the flat all-reduce engine
and ZeRO-2, and a run resumed at another world size continues the same run. The splits: 1 rank, 4
micro-batches of 2; 2 ranks, 2 + 2 each; 3 ranks, shares 3 + 3 + 2 as [2, 1], [2, 1], [2] (micro-batches
of different sizes on a rank, and under ZeRO-2 rank 2's weight-0 padding micro-batch [2, 0]); 5 ranks,
shares 2 + 2 + 2 + 1 + 1. An export (jobs.export) depends on the weights alone, not on what trained them.

Tolerances, and why. Only the arithmetic order differs between world sizes (a rank sums its share, the
all-reduce sums the ranks; a convolution over 3 clips blocks its sums differently than over 4), which
changes a gradient by a few units in its last place (≈1e-7 relative):
- losses agree to rel 1e-5 and gradient norms to rel 2e-5 at every step. This is the sharp check of the
  split: one sample weighted wrongly (a rank's share counted as the average share, say) changes the
  reduced gradient, and its norm, by about a per cent at the first step;
- the weights agree to 2e-3 of the distance training moved them (L2), and to 2e-4 in any one weight.
  AdamW divides each gradient component by its own running size (+ eps = 1e-8), so a component that is
  itself ~1e-8 — where last-place rounding of the sums that produce it is relatively large — can take a
  different step of up to lr (Σ lr over these 5 warmup steps = 7.5e-4). The same arithmetic difference
  between two engines on ONE rank (ZeRO-2 vs all-reduce) measured 8e-4 relative and 1.4e-4 at most.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from taehv_slurm.common.plan import plan_for
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.training import submit_training
from tests.helpers import STEP_BY_STEP, make_cluster, quick_train, read_strictly

pytestmark = pytest.mark.usefixtures("slurm_cluster")

STEPS = 5
WORLD_SIZES = (1, 2, 3, 5)
LOSS_REL, GRAD_NORM_REL, WEIGHTS_REL_L2, WEIGHTS_ATOL = 1e-5, 2e-5, 2e-3, 2e-4
EXACT = {**STEP_BY_STEP, "intervals.record_samples": True, "batch.effective": 8}
# Each rank's micro-batches at 3 ranks (see the module docstring): what the runs must exercise.
SPLIT_AT_3 = {"allreduce": [[2, 1], [2, 1], [2]], "zero2": [[2, 1], [2, 1], [2, 0]]}


def ranks(job_dir: Path, count: int):
    """One testbed node with `count` ranks (one per fake GPU), as `--gpus-per-node count` asks."""
    return make_cluster(job_dir, nodes=1, gpus_per_node=count, time_min=15)


def samples(run_dir: Path) -> dict[int, list[int]]:
    """step → the clip indices of that step, in the order of the ranks' consecutive shares."""
    lines = (Path(run_dir) / "samples.jsonl").read_text().splitlines()
    return {row["step"]: row["samples"] for row in map(json.loads, lines)}


def logged(run_dir: Path, key: str) -> list[float]:
    return [r[key] for r in read_strictly(RunFolder(run_dir).metrics()) if "loss" in r]


def assert_same_run(run: Path, reference: Path) -> None:
    assert samples(run) == samples(reference)  # the same clips in every step, whatever the split
    assert logged(run, "loss") == pytest.approx(logged(reference, "loss"), rel=LOSS_REL)
    assert logged(run, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=GRAD_NORM_REL)
    ours, theirs = params(run), params(reference)
    assert max_difference(ours, theirs) <= WEIGHTS_ATOL
    moved = flat(theirs) - flat(initial_weights())
    assert float((flat(ours) - flat(theirs)).norm() / moved.norm()) <= WEIGHTS_REL_L2


def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([weights[k].flatten() for k in sorted(weights)])


@functools.cache
def initial_weights() -> dict[str, torch.Tensor]:
    """The weights every run starts from (the trainer's own initialisation with the config's seed)."""
    from taehv_slurm.trainer.model import TAEHV, TAEHVConfig, init_for_training

    cfg = quick_train()
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = TAEHV(TAEHVConfig.from_dict(cfg.model_fields()))
        init_for_training(model)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    step, state, _ = Checkpointer(RunFolder(run_dir).checkpoints).load_latest()
    assert step == STEPS
    return state["params"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, int], Path]:
    """Every (engine, world size) run, submitted at once, waited for; run folder by key."""
    job_dir = tmp_path_factory.mktemp("worlds")
    handles = {}
    for engine in ("allreduce", "zero2"):
        for world in WORLD_SIZES:
            train = quick_train(steps=STEPS, **EXACT, **{"engine.kind": engine})
            handles[(engine, world)] = submit_training(ranks(job_dir, world), train, f"{engine}-{world}")[0]
    for key, handle in handles.items():
        assert handle.wait(timeout_s=900, progress=False) == "COMPLETED", (key, handle.tail(40))
    return {key: Path(h.run_dir) for key, h in handles.items()}


@pytest.mark.parametrize("engine", ["allreduce", "zero2"])
def test_every_world_size_trains_the_same_steps(runs, engine: str) -> None:
    for world in WORLD_SIZES[1:]:
        assert_same_run(runs[(engine, world)], runs[(engine, 1)])
    starts = read_strictly(RunFolder(runs[(engine, 3)]).events())
    # the batch split 3+3+2 into micro-batches of at most 2, as the ranks planned it
    assert (starts[0]["world_size"], starts[0]["effective_batch"], starts[0]["grad_accum"]) == (3, 8, 2)
    plan = plan_for(1, 3, quick_train(steps=STEPS, **EXACT, **{"engine.kind": engine}), device="cpu")
    assert [plan.microbatch_sizes(rank) for rank in range(3)] == SPLIT_AT_3[engine]


def test_both_engines_agree(runs) -> None:
    assert_same_run(runs[("zero2", 1)], runs[("allreduce", 1)])


def test_resumed_at_other_world_sizes_and_engines_continues_the_same_run(runs, tmp_path: Path) -> None:
    # 2 ranks (all-reduce, by its old name `ddp`) to step 2, 3 ranks (ZeRO-2) to step 4, 5 ranks (ZeRO-3) to
    # step 5: one run folder, one run.
    for world, engine, until in ((2, "ddp", 2), (3, "zero2", 4), (5, "zero3", STEPS)):
        # lr warmup (20 steps) ignores `steps`
        train = quick_train(steps=until, **EXACT, **{"engine.kind": engine})
        handle = submit_training(ranks(tmp_path, world), train, "resumed")[0]
        assert handle.wait(timeout_s=600, progress=False) == "COMPLETED", handle.tail(40)
    run = tmp_path / "resumed"
    starts = [e for e in read_strictly(RunFolder(run).events()) if e["event"] == "start"]
    assert ([(e["step"], e["world_size"], e["engine"]) for e in starts]
            == [(0, 2, "allreduce"), (2, 3, "zero2"), (4, 5, "zero3")])
    # step by step the clips and numbers of the uninterrupted run
    assert_same_run(run, runs[("allreduce", 1)])


def test_export_depends_only_on_the_weights(runs, tmp_path: Path) -> None:
    """Every engine and world size exports its weights alike: each run's checkpoint gives the same file as
    the one-rank all-reduce checkpoint carrying that run's weights (its optimizer state, RNG, engine and
    world size in meta.json left as they were)."""
    from safetensors.torch import load_file

    from taehv_slurm.trainer.weights import export_weights

    _, host_state, host_meta = Checkpointer(RunFolder(runs[("allreduce", 1)]).checkpoints).load_latest()
    reference = load_file(export_weights(runs[("allreduce", 1)], tmp_path / "reference.safetensors",
                                         "fp32").weights)
    for (engine, world), run in runs.items():
        step, state, meta = Checkpointer(RunFolder(run).checkpoints).load_latest()
        assert (meta["engine"], meta["world_size"]) == (engine, world)
        carried = tmp_path / f"{engine}-{world}-carried"
        Checkpointer(RunFolder(carried).checkpoints).save({**host_state, "params": state["params"]}, step,
                                                          host_meta)
        exported = [export_weights(folder, tmp_path / f"{engine}-{world}-{name}.safetensors", "fp32").weights
                    for folder, name in ((run, "own"), (carried, "carried"))]
        assert exported[0].read_bytes() == exported[1].read_bytes(), (engine, world)
        weights = load_file(exported[0])
        assert list(weights) == list(reference) and max_difference(weights, reference) <= WEIGHTS_ATOL
