"""A run whose steps stop being finite: the budget that stops it, and `divergence.action: rollback`.

The guard's thresholds (docs/failures.md): 3 skipped steps in a row, or 10 within 200 steps; `rollback`
restores the newest checkpoint from before the skipped steps and passes the batches since it, at most
`max_rollbacks` times, then stops. The budget is checked on the guard itself (CPU flags, as the trainer
hands them over); rollback on a real one-rank run in this process (the tiny config without its teacher at
lr 0.5: its first step is finite, every later one is not).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from taehv_slurm.common.config import load_train
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.trainer.divergence import DivergenceGuard
from tests.helpers import quick_train, read_strictly

CPU = torch.device("cpu")


def guard(**divergence: object) -> DivergenceGuard:
    return DivergenceGuard(load_train({"divergence": divergence}).divergence, CPU)


def first_decision(g: DivergenceGuard, skipped: set[int], steps: int) -> tuple[int, str] | None:
    """(step, decision) at the first step the guard says what to do, feeding it `steps` flags."""
    for step in range(steps):
        decision = g.observe(step, torch.tensor(step in skipped))
        if decision is not None:
            return step, decision
    return None


def test_three_skipped_steps_in_a_row_stop_the_run() -> None:
    g = guard()
    assert first_decision(g, {5, 6, 8, 9, 11, 12, 13}, 100) == (13, "stop")  # a finite step resets the count
    assert g.spent() == "was not finite in 3 steps in a row (divergence.max_consecutive=3)"


def test_ten_skipped_steps_within_200_stop_the_run() -> None:
    """Never two in a row: every 22nd step puts the 10th skip at step 198, within 200 steps of the first;
    every 23rd step never has more than 9 in any 200 steps, and the run goes on."""
    g = guard()
    assert first_decision(g, set(range(0, 2000, 22)), 2000) == (198, "stop")
    assert g.spent() == "was not finite in 10 of the last 200 steps (divergence.max_in_window=10)"
    assert first_decision(guard(), set(range(0, 2000, 23)), 2000) is None
    # the thresholds are the config's
    assert first_decision(guard(max_in_window=4, window=50), set(range(0, 500, 13)), 500) == (39, "stop")


def test_rollback_is_tried_max_rollbacks_times_then_the_run_stops() -> None:
    g = guard(action="rollback", max_rollbacks=2)
    for _ in range(2):
        assert first_decision(g, {0, 1, 2}, 10) == (2, "rollback")
        g.rolled_back()  # the budget starts afresh on the restored state
    assert first_decision(g, {0, 1, 2}, 10) == (2, "stop")
    # rollbacks done by earlier attempts (the checkpoint records them) count too
    rollback = load_train({"divergence": {"action": "rollback", "max_rollbacks": 2}}).divergence
    resumed = DivergenceGuard(rollback, CPU, rollbacks_done=2)
    assert first_decision(resumed, {0, 1, 2}, 10) == (2, "stop")


def test_a_rolled_back_run_restores_the_checkpoint_before_and_passes_the_batches(tmp_path: Path) -> None:
    """Step 1 is finite and saved; steps 2-4 are not: the run goes back to step 1 and passes the 3 batches
    that diverged, twice (max_rollbacks 2), then stops in one line. No checkpoint is written while steps are
    skipped, and the one the run went back to records the batches passed, so a requeue keeps them."""
    from taehv_slurm.trainer.build import build_sources
    from taehv_slurm.trainer.data import GlobalOrder
    from taehv_slurm.trainer.task import TrainTask
    from taehv_slurm.trainer.train import DivergedError

    cfg = quick_train(steps=40, **{"optim.lr": 0.5, "intervals.ckpt_every": 1, "intervals.log_every": 1,
                                   "intervals.val_every": 1000, "intervals.record_samples": True,
                                   "divergence.action": "rollback", "divergence.max_rollbacks": 2})
    run = tmp_path / "rb"
    with pytest.raises(DivergedError) as err:
        TrainTask(cfg.to_dict(), {"device": "cpu", "torch_threads": 1, "run_dir": str(run)})()
    assert str(err.value).startswith("step 4: the loss or gradient norm was not finite in 3 steps in a row")
    assert "the last checkpoint is step 1 (" in str(err.value)
    assert str(err.value).endswith("(rolled back 2 time(s) already)")
    events = read_strictly(RunFolder(run).events())
    rollbacks = [(e["from_step"], e["to_step"], e["skipped_batches"], e["rollbacks"]) for e in events
                 if e["event"] == "rollback"]
    assert rollbacks == [(4, 1, 3, 1), (4, 1, 3, 2)]
    # step 1's own checkpoint, then each rollback's save of the restored state
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [1, 1, 1]
    _, _, meta = Checkpointer(RunFolder(run).checkpoints).load_latest()
    assert (meta["step"], meta["data_offset_steps"], meta["rollbacks"]) == (1, 6, 2)
    # What was logged after the step gone back to is dropped: each step once, the last path's.
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Step k of the last path trains on the clips of step k + 6: the 2 × 3 batches that diverged are passed.
    order, batch = GlobalOrder(len(build_sources(cfg)[0]), cfg.seed), cfg.batch.effective
    for row in rows:
        passed = 6 if row["step"] > 1 else 0
        start = (row["step"] - 1 + passed) * batch
        assert row["samples"] == [order.item_at(p) for p in range(start, start + batch)], row["step"]
