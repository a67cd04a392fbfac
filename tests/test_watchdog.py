"""The hang watchdog's clock, by section (docs/failures.md): a section times out after max(floor, factor ×
the slowest time seen in it), not counting its first two occurrences (compilation, cold caches), and after
`hang_uncalibrated_s` until three more were seen; the sections a training rank passes through are
startup, step, data, validate and save. Real threads, rank files and a one-rank training in this process;
tests/test_hangs.py finds a frozen rank of a real Slurm job.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm.runtime.ranks import RankFile
from taehv_slurm.runtime.watchdog import SectionClock, Verdict, Watchdog, WatchdogSettings
from tests.helpers import quick_train


def test_a_section_is_timed_against_what_was_seen_of_it_after_its_warm_up() -> None:
    """With the cluster config's defaults: floor 60 s, factor 5, 1800 s until calibrated."""
    clock = SectionClock(WatchdogSettings())
    for seconds in (500.0, 400.0, 10.0, 14.0):  # two warm-ups (not counted), then two of the three needed
        clock.finished("step", seconds)
        assert clock.timeout("step") == 1800
    clock.finished("step", 12.0)
    assert clock.timeout("step") == 5 * 14.0  # the slowest after the warm-up, not the 500 s compilation
    clock.finished("step", 1.0)
    assert clock.timeout("step") == 70.0
    assert clock.timeout("validate") == 1800  # each section keeps its own count
    for seconds in (30.0, 30.0, 2.0, 3.0, 2.5):
        clock.finished("data", seconds)
    assert clock.timeout("data") == 60.0  # 5 × 3 s is under the floor


def test_a_rank_stuck_reading_data_is_named_by_the_ranks_waiting_in_their_step(tmp_path: Path) -> None:
    """Three ranks calibrated on quick steps and data reads (floor 0.3 s); at step 7 rank 2 stays in its
    data read: the others time out in `step` after the floor, and rank 0 names rank 2 and its section."""
    settings = WatchdogSettings(interval_s=0.05, floor_s=0.3, factor=5.0, uncalibrated_s=30.0)
    found: list[Verdict] = []
    dogs = []
    for rank in range(3):
        record = RankFile(tmp_path, "77", 0, rank, 3)
        dogs.append(Watchdog(tmp_path, record, settings, on_hang=lambda verdict, _: found.append(verdict)))
    try:
        for dog in dogs:
            dog.start()
            for step in range(6):  # startup, then 6 quick steps, each with a data read
                dog.enter("data", step)
                dog.enter("step", step)
        stuck_at = time.monotonic()
        for rank, dog in enumerate(dogs):
            dog.enter("data" if rank == 2 else "step", 7)
        (verdict,) = wait_for(lambda: found, 10, "the hang to be found")
        found_after = time.monotonic() - stuck_at
    finally:
        for dog in dogs:
            dog.stop(0)
    assert 0.3 <= found_after < 5
    assert [r["rank"] for r in verdict.culprits] == [2] and verdict.section == "step"
    assert verdict.why[2].startswith("stuck in data at step 7 for ") and verdict.timeout_s == 0.3
    line = (tmp_path / "hang-77-0" / "verdict.txt").read_text()
    assert line.startswith(f"hang: rank 2 on {verdict.hosts[0]} stuck in data at step 7 for "), line


@pytest.mark.parametrize("frozen", [1, 0])
def test_a_frozen_peer_is_a_hang_past_the_floor_even_in_an_uncalibrated_section(tmp_path: Path,
                                                                                  frozen: int) -> None:
    """Three ranks in their first save (uncalibrated: 30 s); rank `frozen` stopped refreshing its record (a
    SIGSTOPped process): the others name it once it is stale and they have waited the floor, not 30 s.
    Rank 0 reads every record and the others only rank 0's, so a frozen rank 0 is found by the others."""
    settings = WatchdogSettings(interval_s=0.05, floor_s=0.3, factor=5.0, uncalibrated_s=30.0)
    found: list[Verdict] = []
    dogs, records = [], {}
    for rank in range(3):
        records[rank] = RankFile(tmp_path, "78", 0, rank, 3)
        if rank != frozen:
            dogs.append(Watchdog(tmp_path, records[rank], settings, lambda verdict, _: found.append(verdict)))
    records[frozen].enter("step", 4)
    records[frozen].started()  # written once, never again: its process is stopped
    try:
        for dog in dogs:
            dog.start()
            dog.enter("save", 4)
        (verdict,) = wait_for(lambda: found, 15, "the frozen rank to be named")
        found_after = time.time() - records[frozen].record.time
    finally:
        for dog in dogs:
            dog.stop(0)
    assert [r["rank"] for r in verdict.culprits] == [frozen] and verdict.section == "save"
    assert verdict.why[frozen].startswith("stopped (no sign of life for ")
    assert settings.stale_after_s < found_after < settings.stale_after_s + 3


def test_a_training_rank_marks_every_section(tmp_path: Path) -> None:
    """A short one-rank training run under a watchdog passes through each section the docs name, so a hang
    in a validation or a save is timed against validations and saves, and named as such."""
    from taehv_slurm.runtime.context import RunContext, StopFlag, grace_seconds
    from taehv_slurm.runtime.distenv import DistEnv
    from taehv_slurm.runtime.rank_backend import RankBackend
    from taehv_slurm.trainer.task import TrainTask

    env = DistEnv.from_environ({})
    dog = Watchdog(tmp_path, RankFile(tmp_path, env.job_id, 0, 0, 1), WatchdogSettings(), lambda v, b: None)
    dog.start()
    ctx = RunContext(tmp_path, env, StopFlag(grace_seconds(70, 30)), 0, RankBackend(), dog)
    try:
        train = quick_train(steps=4, **{"intervals.val_every": 2, "intervals.ckpt_every": 2})
        TrainTask(train.to_dict(), {"device": "cpu", "torch_threads": 1})(ctx)
    finally:
        dog.stop(0)
    seen = dog.clock.seen  # how often each section was left: every one the rank passed through
    assert set(seen) == {"startup", "step", "data", "validate", "save"}, seen
    # 4 steps of 2 micro-batches, each read in `data`; validated and saved at steps 2 and 4
    assert (seen["startup"], seen["data"], seen["validate"], seen["save"]) == (1, 8, 2, 2), seen
