"""A failing experiment tracker never stops training or its save (README, "Experiment trackers").

One-rank training runs in this process with MLflow turned on, and MLflow failing for real: its server
unreachable from the start (a closed port), or its file store removed from under a running attempt. The
run trains every step, saves, and says once that the tracker stopped; tests/test_requeue.py has the
trackers working across a preempted run.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from taehv_slurm.common.runfolder import RunFolder
from tests.helpers import quick_train, read_strictly

STEPS = 6


def train_with_mlflow(run: Path, uri: str) -> dict:
    from taehv_slurm.trainer.task import TrainTask

    sets = {"intervals.log_every": 1, "intervals.ckpt_every": 2, "intervals.val_every": 1000,
            "tracking.mlflow": True, "tracking.mlflow_tracking_uri": uri, "tracking.sample_frames": 0}
    return TrainTask(quick_train(steps=STEPS, **sets).to_dict(),
                     {"device": "cpu", "torch_threads": 1, "run_dir": str(run)})()


def trained(run: Path) -> tuple[list[int], list[str]]:
    """The steps metrics.jsonl logged and the checkpoints kept."""
    rows = read_strictly(RunFolder(run).metrics())
    saved = sorted(p.name for p in RunFolder(run).checkpoints.glob("step_*"))
    return [r["step"] for r in rows if "loss" in r], saved


def stopped(printed: str) -> list[str]:
    """The rank log's lines (rank 0 prints them on its stdout) that say a tracker stopped."""
    lines = printed.splitlines()
    return [line.split("] ", 1)[1] for line in lines if "tracking stopped for this attempt" in line]


def test_a_tracker_whose_server_is_down_from_the_start_never_stops_training(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once instead of retrying
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    result = train_with_mlflow(tmp_path / "down", f"http://127.0.0.1:{closed}")
    assert result["step"] == STEPS
    assert trained(tmp_path / "down") == (list(range(1, STEPS + 1)), ["step_00000004", "step_00000006"])
    (line,) = stopped(capsys.readouterr().out)
    assert line.startswith("mlflow tracking stopped for this attempt: ") and str(closed) in line


def test_a_tracker_that_fails_mid_run_never_stops_training_or_its_save(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run, store = tmp_path / "mid", tmp_path / "mlruns"
    metrics = RunFolder(run).metrics().path

    def lose_the_store_after_step_2() -> None:  # from outside the trainer, as a lost mount would
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            threading.Event().wait(0.01)
        store.rename(tmp_path / "lost")  # at once: an rmtree raced the tracker's writes into the folder

    remover = threading.Thread(target=lose_the_store_after_step_2, daemon=True)
    remover.start()
    result = train_with_mlflow(run, store.as_uri())
    remover.join(timeout=10)
    # the store moved away (MLflow may make an empty folder at its path again: the run's data is not there)
    assert result["step"] == STEPS and (tmp_path / "lost").is_dir() and not remover.is_alive()
    assert trained(run) == (list(range(1, STEPS + 1)), ["step_00000004", "step_00000006"])
    (line,) = stopped(capsys.readouterr().out)  # once, then the attempt logs without it
    assert line.startswith("mlflow tracking stopped for this attempt: ")
