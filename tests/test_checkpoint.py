"""Atomic checkpoints on the real filesystem: round trip, retention, async, SIGKILL mid-write, disk full."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from taehv_slurm.runtime.checkpoint import Checkpointer, CheckpointError
from tests.helpers import mounted_tmpfs

REPO = Path(__file__).resolve().parents[1]


def state_for(step: int, mib: float = 1.0) -> dict:
    n = int(mib * 2**20 / 4)
    return {"params": {"w": torch.full((n,), float(step)), "b": torch.arange(7.0) + step},
            "optimizer_step": step, "rng": [{"torch": torch.get_rng_state()}], "note": "plain values only"}


def test_round_trip_and_latest(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    assert ckpt.load_latest() is None
    ckpt.save(state_for(10), 10, {"world_size": 4})
    ckpt.save(state_for(20), 20, {"world_size": 4})
    step, state, meta = ckpt.load_latest()
    assert step == 20 and meta["world_size"] == 4 and meta["step"] == 20
    assert torch.equal(state["params"]["w"], torch.full_like(state["params"]["w"], 20.0))
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_00000020"
    assert oct((tmp_path / "ck").stat().st_mode & 0o777) == oct(0o700)


def test_retention_keeps_the_last_k(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=3)
    for step in range(1, 7):
        ckpt.save(state_for(step, 0.01), step)
    assert ckpt.steps() == [4, 5, 6]


def test_async_save_returns_before_the_write_and_lands(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=2)
    start = time.perf_counter()
    ckpt.save(state_for(5, 64), 5, blocking=False)
    handed_off = time.perf_counter() - start
    ckpt.wait()
    assert ckpt.load_latest()[0] == 5
    assert handed_off < ckpt.last_save_seconds  # training continued while the writer fsynced


def test_load_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    """Bytes overwritten at the same size fail the checksum; where the checksum was rewritten too (or a
    checkpoint of a release without checksums), torch's own load fails, and the message says the file is
    damaged in the library's words with torch's reason, never torch's headline about weights_only."""
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state_for(3, 0.01), 3)
    folder = tmp_path / "step_00000003"
    written = (folder / "state.pt").read_bytes()
    meta = json.loads((folder / "meta.json").read_text())
    # Not a zip, so torch unpickles it: the first byte, 'n' (110), is no pickle opcode it accepts.
    text = (b"not a checkpoint " * len(written))[:len(written)]
    zip_end_zeroed = written[:-100] + bytes(100)  # a zip whose directory is gone: torch's reason, whatever
    for damaged, reason in ((text, f"Unsupported operand {ord('n')}"), (zip_end_zeroed, None)):
        assert len(damaged) == len(written)
        (folder / "state.pt").write_bytes(damaged)
        (folder / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(CheckpointError) as err:
            ckpt.load(3)
        assert str(err.value) == (f"cannot load checkpoint {folder}: state.pt does not match its checksum "
                                  "(overwritten since it was saved); delete that folder to resume from an "
                                  "older one (it was not loaded)")
        for files in ({"state.pt": {"bytes": len(damaged), "sha256": hashlib.sha256(damaged).hexdigest()}},
                      None):  # rewritten with the file; none at all (written before checksums)
            (folder / "meta.json").write_text(json.dumps({**meta, "files": files}))
            with pytest.raises(CheckpointError) as err:
                ckpt.load(3)
            found = re.fullmatch(rf"cannot load checkpoint {re.escape(str(folder))}: state\.pt is damaged or "
                                 r"not a torch checkpoint: cut short, overwritten, or not written by this "
                                 r"library \(([^\n]+)\); delete that folder to resume from an older one \(it "
                                 r"was not loaded\)", str(err.value))
            assert found, str(err.value)
            if reason is not None:
                assert found.group(1) == reason
            else:
                assert "weights" not in found.group(1).lower(), found.group(1)


def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_older_one_resumes(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=3)
    for step in (10, 20):
        ckpt.save(state_for(step, 0.01), step)
    newest = tmp_path / "step_00000020" / "state.pt"
    whole = newest.read_bytes()
    newest.write_bytes(whole[: len(whole) // 2])  # cut short, as by a full disk or a kill during a copy
    step, state, _ = ckpt.load_latest()
    assert step == 10 and state["optimizer_step"] == 10
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step_00000020.damaged-")]
    # kept, unchanged
    assert len(aside) == 1 and (aside[0] / "state.pt").read_bytes() == whole[: len(whole) // 2]
    assert (tmp_path / "latest").read_text().strip() == "step_00000010"
    assert len(ckpt.moved_aside) == 1 and "\n" not in ckpt.moved_aside[0]
    cause = f"state.pt has {len(whole) // 2} bytes, {len(whole)} were written (cut short or overwritten)"
    assert ckpt.moved_aside[0].startswith(f"checkpoint step 20 is damaged ({cause})")
    assert "resuming from step 10" in ckpt.moved_aside[0]
    assert Checkpointer(tmp_path).steps() == [10]  # the damaged one is no longer a checkpoint
    ckpt.save(state_for(30, 0.01), 30)  # and saving goes on past it
    assert ckpt.load_latest()[0] == 30 and aside[0].exists()


def test_only_damaged_checkpoints_start_from_scratch(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state_for(5, 0.01), 5)
    (tmp_path / "step_00000005" / "meta.json").write_text('{"step": 5, "sav')
    assert ckpt.load_latest() is None
    assert "no older checkpoint: starting from step 0" in ckpt.moved_aside[0]
    assert not (tmp_path / "latest").exists()


# A zygote process imports torch once, never starts a thread pool, and forks one writer per trial
# (forking the test process itself could deadlock on torch's intra-op threads).
ZYGOTE = """
import os, sys, torch
torch.set_num_threads(1)
from taehv_slurm.runtime.checkpoint import Checkpointer
directory = sys.argv[1]
for line in sys.stdin:
    first = int(line)
    pid = os.fork()
    if pid == 0:
        ckpt, step = Checkpointer(directory, keep=2), first
        while True:
            step += 1
            n = 2**20
            state = {"params": {"w": torch.full((n,), float(step)), "b": torch.arange(7.0) + step},
                     "optimizer_step": step}
            ckpt.save(state, step, blocking=step % 2 == 0)
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def test_sigkill_at_random_instants_never_leaves_a_partial_latest(tmp_path: Path) -> None:
    rng = random.Random(1234)
    directory = tmp_path / "ck"
    Checkpointer(directory).save(state_for(0, 4), 0)
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    steps_seen = []
    try:
        for trial in range(25):
            zygote.stdin.write(f"{1000 * (trial + 1)}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.8))
            os.kill(pid, signal.SIGKILL)
            assert zygote.stdout.readline().strip() == "reaped"
            step, state, meta = Checkpointer(directory).load_latest()
            assert meta["step"] == step == state["optimizer_step"]
            assert torch.equal(state["params"]["w"], torch.full_like(state["params"]["w"], float(step)))
            steps_seen.append(step)
    finally:
        zygote.kill()
        zygote.wait()
    assert len(set(steps_seen)) > 5, steps_seen  # the kills landed at many different points of the writes


@pytest.fixture
def small_disk(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "small", "size=3m") as mount:
        yield mount


def test_disk_full_keeps_the_previous_latest(small_disk: Path) -> None:
    ckpt = Checkpointer(small_disk / "ck", keep=3)
    ckpt.save(state_for(1, 1), 1)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(state_for(2, 2.5), 2)
    message = str(err.value)
    assert "No space left on device" in message and "previous checkpoint (step 1) is intact" in message
    step, state, _ = ckpt.load_latest()
    assert step == 1 and state["optimizer_step"] == 1
    assert not list((small_disk / "ck").glob("*.tmp-*"))  # the partial write was cleaned up


def test_a_write_refused_in_the_job_folder_is_lasting_and_a_nodes_own_disk_is_not(small_disk: Path) -> None:
    """The run stops at once only where any node would meet the same refusal: a file of the job folder (on
    storage every node shares), refused as full (a real full disk here), read-only or not permitted. A
    node's own /tmp full is that node's fault (a restart without it may mend it); an I/O error, neither."""
    from taehv_slurm.common.runfolder import RunFolder

    run = RunFolder(small_disk / "jobs" / "run")
    ckpt = Checkpointer(run.checkpoints)
    ckpt.save(state_for(1, 1), 1)
    (small_disk / "filler").write_bytes(b"\0" * 4096)  # its page, then all the rest
    subprocess.run(["fallocate", "-l", str(os.statvfs(small_disk).f_bavail * 4096), str(small_disk / "more")],
                   check=True)
    with pytest.raises(OSError) as full:
        for _ in range(10_000):  # past the slack of the file's last page
            run.events().write("checkpoint", step=1, padding="x" * 400)
    assert full.value.filename == str(run.events().path)  # the event log names its file (os.write does not)
    assert ckpt.lasting_failure(full.value) == (
        f"OSError: No space left on device: {run.events().path}; the last checkpoint (step 1) is intact; "
        "free space there, then submit the run again: it resumes from step 1")
    assert ckpt.no_room() is not None and "No space left on device" in ckpt.no_room()
    node_tmp = OSError(full.value.errno, full.value.strerror, "/tmp/torchinductor_root/abc.so")
    io_error = OSError(5, "Input/output error", str(run.events().path))
    unnamed = OSError(full.value.errno, full.value.strerror)
    assert [ckpt.lasting_failure(e) for e in (node_tmp, io_error, unnamed)] == [None, None, None]
    # the node's own disk (its file outside the job folder, or one no file names): that node is left out
    nodes_disk = [ckpt.on_a_nodes_disk(e) for e in (full.value, node_tmp, io_error, unnamed)]
    assert nodes_disk == [False, True, False, True]


def test_preflight_wants_room_for_the_checkpoints_kept_and_one_more(tmp_path: Path) -> None:
    """Preflight's `checkpoint folder` row asks for keep_checkpoints + 1 checkpoints (a new one is complete
    before the oldest goes), each the model's fp32 weights and two AdamW moments (12 bytes a parameter) plus
    the ranks' RNG states: the tiny config's 2 + 1 of ≈4.5 MB do not fit 8 MiB, and fit 32 MiB."""
    from taehv_slurm.preflight_checks import Preflight
    from taehv_slurm.trainer.model import TAEHV, TAEHVConfig
    from tests.helpers import tiny_train

    train = tiny_train()
    states = 12 * sum(p.numel() for p in TAEHV(TAEHVConfig.from_dict(train.model_fields())).parameters())
    rows = {}
    for mib in (8, 32):
        with mounted_tmpfs(tmp_path / f"disk-{mib}", f"size={mib}m") as disk:
            check = Preflight(str(REPO / "configs/cluster/local.yaml"), str(REPO / "configs/train/tiny.yaml"),
                              {"job_dir": str(disk / "runs")}, {})
            check.check_configs()
            check.check_job_dir()
            (rows[mib],) = [row for row in check.rows if row.check == "checkpoint folder"]
            assert list(disk.iterdir()) == []  # probed, nothing left behind
    sizes = re.search(r"2 checkpoints of ≈([\d.]+) MB \(\+1 while saving\) need ([\d.]+) MB", rows[8].detail)
    each, need = float(sizes.group(1)) * 1e6, float(sizes.group(2)) * 1e6
    assert states <= each <= states + 2**20 and need == pytest.approx(3 * each, abs=0.15e6), rows[8].detail
    assert rows[8].result == "FAIL" and rows[8].detail.endswith(
        ": free space there, lower intervals.keep_checkpoints or move job_dir")
    assert rows[32].result == "PASS", rows[32].detail
