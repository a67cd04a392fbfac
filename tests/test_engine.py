"""Every engine (flat all-reduce, DeepSpeed ZeRO-1/2/3) trains, and its state moves to every other engine
unchanged.

One real torch.distributed process group (gloo, world size 1) in this process: DeepSpeed needs one even
for one rank. The multi-rank paths run on the Slurm testbed (tests/test_requeue.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from taehv_slurm.trainer.engine import Microbatch, make_engine
from taehv_slurm.trainer.losses import DistillModule
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig

ENGINES = ["allreduce", "zero1", "zero2", "zero3"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with pytest.MonkeyPatch.context() as environ:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_WORLD_SIZE": "1"}.items():
            environ.setenv(key, value)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        yield
        dist.destroy_process_group()


def engine(kind: str, device: str = "cpu"):
    torch.manual_seed(0)
    module = DistillModule(TAEHV(TAEHVConfig(encoder_width=8, decoder_widths=[16, 8, 8, 8]))).to(device)
    return make_engine(kind, module, torch.device(device), precision="fp32", grad_clip=1.0, lr=1e-3,
                       betas=(0.9, 0.95), weight_decay=0.01, compile=False, per_gpu_batch=2, grad_accum=2)


def batch(seed: int) -> Microbatch:
    """Two clips: half of a 4-clip step."""
    g = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, 256, (2, 8, 3, 32, 32), dtype=torch.uint8, generator=g)
    return Microbatch(frames, torch.randn(2, 2, 16, 4, 4, generator=g) * 0.1, 0.5)


def loss_of(step) -> float:
    return step.means()["loss"]


@pytest.mark.parametrize("kind", ENGINES)
def test_engine_trains_and_hands_its_state_to_every_other_engine(kind: str) -> None:
    source = engine(kind)
    losses = [loss_of(source.train_step([batch(2 * s), batch(2 * s + 1)], 1e-3)) for s in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    state = source.full_state()
    assert state["optimizer_step"] == 3 and state["exp_avg"] and set(state["params"]) == set(state["exp_avg"])
    for other in ENGINES:
        target = engine(other)
        target.load_full_state(state)
        moved = target.full_state()
        assert moved["optimizer_step"] == 3
        for key in ("params", "exp_avg", "exp_avg_sq"):
            for name, value in state[key].items():
                torch.testing.assert_close(moved[key][name], value, rtol=0, atol=0,
                                           msg=f"{kind}→{other} {key} {name}")
        # the same weights reconstruct a clip alike (ZeRO-3 gathers its shards for the sample frames)
        clip = batch(7).frames[:1]
        torch.testing.assert_close(target.reconstruct(clip), source.reconstruct(clip), rtol=0, atol=1e-6,
                                   msg=f"{kind}→{other} reconstruction")
        # and it keeps training from there: the next step is the same whichever engine takes it
        after = loss_of(target.train_step([batch(100), batch(101)], 1e-3))
        assert after == pytest.approx(source_next_loss(state), rel=1e-5)


def source_next_loss(state) -> float:
    reference = engine("allreduce")
    reference.load_full_state(state)
    return loss_of(reference.train_step([batch(100), batch(101)], 1e-3))


# Rank RANK of 2 (gloo): for each engine, 4 steps straight, and 2 steps, the full state handed to a new
# engine (what a checkpoint holds), 2 more; prints per engine whether the two end bit for bit alike.
RESUME_AT_TWO_RANKS = """
import sys
import torch
from taehv_slurm.runtime.distenv import DistEnv, destroy_distributed, init_distributed
from tests.test_engine import batch, engine
rank, port = int(sys.argv[1]), int(sys.argv[2])
init_distributed(DistEnv(rank, rank, 2, 2, 0, 1, "127.0.0.1", port, "resume", "single"), "gloo",
                 timeout_s=120, rendezvous_timeout_s=60, use_cuda=False)
def train(e, first, last):
    for s in range(first, last):  # each rank its own clips: 4 * s + 2 * rank, + 1
        e.train_step([batch(4 * s + 2 * rank), batch(4 * s + 2 * rank + 1)], 1e-3)
def same(a, b):
    return all(torch.equal(a[k][n], b[k][n]) for k in ("params", "exp_avg", "exp_avg_sq") for n in a[k]) \
        and a["optimizer_step"] == b["optimizer_step"] == 4
for kind in sys.argv[3].split(","):
    straight = engine(kind)
    train(straight, 0, 2)
    saved = straight.full_state()
    train(straight, 2, 4)
    resumed = engine(kind)
    resumed.load_full_state(saved)
    train(resumed, 2, 4)
    print(kind, same(straight.full_state(), resumed.full_state()), flush=True)
torch.distributed.barrier()
destroy_distributed()  # gloo's threads joined: leaving with the group alive can abort at exit
"""


def test_a_resume_at_the_same_world_size_and_engine_is_bit_identical_at_two_ranks() -> None:
    """README: a requeued run resumes bit-identical at the same world size and engine. For every engine at
    two real ranks (ZeRO's states partitioned over them): a new engine given the full state of step 2
    ends step 4 with the weights and AdamW moments of the one that never stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-c", RESUME_AT_TWO_RANKS]
    ranks = [subprocess.Popen([*argv, str(rank), str(port), ",".join(ENGINES)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
        said = [line for line in out.splitlines() if line.split(" ")[0] in ENGINES]  # not DeepSpeed's lines
        assert said == [f"{kind} True" for kind in ENGINES], out + err[-2000:]


def test_the_allreduce_engine_sends_what_backward_wrote_from_one_buffer_of_plain_tensors() -> None:
    """Backward writes every gradient into the one buffer the all-reduce sends (no copy), and each
    gradient shares its memory without being an autograd view of it: torch.compile fakes every
    parameter's .grad at each compile, and rebuilding the views cost 6-7 s of every start."""
    trained = engine("allreduce")
    trained.train_step([batch(0), batch(1)], 1e-3)
    grads = [p.grad for p in trained.module.parameters() if p.requires_grad]
    sent = trained.flat_grad[:-1]
    assert torch.equal(sent, torch.cat([g.reshape(-1) for g in grads])) and bool(sent.abs().sum() > 0)
    assert all(g.untyped_storage().data_ptr() == sent.untyped_storage().data_ptr() for g in grads)
    assert not any(g._is_view() for g in grads)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_non_finite_step_is_never_applied(kind: str) -> None:
    assert_non_finite_step_skipped(kind, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_fused_gpu_optimizer_skips_a_non_finite_step_on_the_device() -> None:
    assert_non_finite_step_skipped("allreduce", "cuda")  # fused AdamW's found_inf: no host sync


def assert_non_finite_step_skipped(kind: str, device: str) -> None:
    def on_device(b: Microbatch) -> Microbatch:
        return Microbatch(b.frames.to(device), b.latents.to(device), b.weight)

    trained = engine(kind, device)
    trained.train_step([on_device(batch(0)), on_device(batch(1))], 1e-3)
    before = trained.full_state()
    poisoned = on_device(batch(2))
    frames = poisoned.frames.float()
    frames[0, 0, 0, 0, 0] = float("nan")  # one pixel of one clip: the whole step's loss is NaN
    result = trained.train_step([Microbatch(frames, poisoned.latents, 0.5), on_device(batch(3))], 1e-3)
    assert bool(result.skipped)
    after = trained.full_state()
    assert after["optimizer_step"] == before["optimizer_step"]  # AdamW did not count it either
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in before[key].items():
            assert torch.equal(after[key][name], value), f"{kind}: {key} {name} changed by a skipped step"
    assert not bool(trained.train_step([on_device(batch(4)), on_device(batch(5))], 1e-3).skipped)
    assert trained.full_state()["optimizer_step"] == before["optimizer_step"] + 1  # and training goes on


def test_a_zero_rank_starts_without_importing_mlflow_and_can_still_log_to_it() -> None:
    """DeepSpeed's autotuner (never run here) imports mlflow when deepspeed is imported: ~2 CPU-s at every
    ZeRO rank's start. The engine hides it for that import only; a tracker imports mlflow afterwards."""
    pytest.importorskip("mlflow")
    code = ("import sys; from taehv_slurm.trainer.engine import _import_deepspeed; _import_deepspeed(); "
            "hidden = 'mlflow' not in sys.modules; import mlflow; print(hidden, mlflow.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.stdout.splitlines()[-1:] == ["True mlflow"], out.stdout[-2000:] + out.stderr[-2000:]
