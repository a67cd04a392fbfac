"""Data preparation (jobs.prepare, trainer.prepare, trainer.prepared) with real videos, the tiny
random-weight teacher and, for the job itself, the real Slurm testbed.

The videos come from bench/videos.py: frame k of each has a flat color that encodes k, so a stored
window can be checked for being exactly the frames it claims to be.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from bench.faults import wait_for
from bench.videos import nearest_frame, write_garbage, write_video
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.trainer.data import ClipSpec, VideoFolderClips
from taehv_slurm.trainer.manifest import INDEX_FILE, MANIFEST_FILE, PrepareSettings, index_windows
from taehv_slurm.trainer.prepare_task import PrepareTask, should_abandon
from taehv_slurm.trainer.prepared import PreparedClips
from taehv_slurm.trainer.shapes import teacher_frame_count
from taehv_slurm.trainer.shards import read_shard_header, shard_path, verify, write_shard
from taehv_slurm.trainer.teacher import load_teacher
from taehv_slurm.training import submit_training
from tests.helpers import REPO, cli, make_cluster, metrics, tiny_train, wait_done

SPEC = ClipSpec(frames=8, height=64, width=64)
LENGTHS = (24, 30, 36, 40, 28, 20)  # frames per video: 3, 3, 4, 5, 3, 2 non-overlapping 8-frame windows


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    for i, n in enumerate(LENGTHS):  # one in a subfolder: indexing is recursive, paths relative to the root
        write_video((_mkdir(root / "nested") if i == 3 else root) / f"clip{i}.mp4", n, 64, 64)
    write_garbage(root / "corrupt.mp4")  # must be skipped at indexing and counted as unreadable
    return root


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def restored_environ() -> Iterator[None]:
    """A task run in this process exports RANK/WORLD_SIZE/MASTER_* (for libraries that read them);
    they must not leak into later submissions, whose jobs inherit this environment."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def prepared(videos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder prepared here by the worker itself (one rank, no Slurm): 8×64×64, shards of 3."""
    out = tmp_path_factory.mktemp("prepared")
    settings = PrepareSettings(str(videos), SPEC.frames, SPEC.height, SPEC.width, shard_size=3,
                               teacher_path="random:tiny").validate()
    index_windows(settings).write(out)
    with restored_environ():
        result = PrepareTask(out, {"device": "cpu", "torch_threads": 1}, batch=2)()
    assert result["ok"] and result["shards_done"] == result["shards"] == 7  # 20 windows in shards of 3
    return out


def relative(path: str, root: Path) -> str:
    return Path(path).relative_to(root).as_posix()


def frame_numbers(frames: torch.Tensor) -> list[int]:
    return [nearest_frame(f.numpy(), range(54)) for f in frames]


# ------------------------------------------------------------------------------- without Slurm


def test_round_trip_alignment_and_order(prepared: Path, videos: Path) -> None:
    clips = VideoFolderClips(videos, SPEC)  # the training windowing, indexed independently
    assert clips.skipped == {"unreadable": 1}
    index = pd.read_csv(prepared / INDEX_FILE)
    assert list(index.columns) == ["window", "video", "window_start", "shard", "offset"]
    assert list(zip(index.video, index.window_start)) == [(relative(p, videos), s) for p, s in clips.windows]
    assert (list(index.window) == list(range(len(clips)))
            and not index.duplicated(["video", "window_start"]).any())

    data = PreparedClips(prepared, SPEC)
    assert len(data) == len(clips) == 20
    latent_frames = SPEC.frames // 4
    for i in range(len(data)):
        item = data[i]
        assert item["index"] == i
        assert item["frames"].dtype == torch.uint8 and item["frames"].shape == (8, 3, 64, 64)
        assert item["latents"].dtype == torch.bfloat16 and item["latents"].shape == (latent_frames, 16, 8, 8)
        assert torch.equal(item["frames"], clips[i]["frames"])  # the window the index names, whole
        start = clips.windows[i][1]
        assert frame_numbers(item["frames"]) == list(range(start, start + 8))

    # The teacher saw exactly frames[:4L-3] of the stored window: encode those directly, 1 + 4k layout.
    frames = torch.stack([data[i]["frames"] for i in range(6)])
    stored = torch.stack([data[i]["latents"] for i in range(6)]).float()
    seen = teacher_frame_count(SPEC.frames)
    assert seen == 4 * latent_frames - 3 == 5
    teacher = load_teacher("hunyuanvideo", "random:tiny")
    x = frames[:, :seen].float().div(255).mul(2).sub(1).permute(0, 2, 1, 3, 4)  # N×C×T×H×W in [-1, 1]
    with torch.no_grad():
        direct = teacher.encoder(x) * teacher.scaling_factor
    assert direct.shape[2] == latent_frames
    torch.testing.assert_close(stored, direct.permute(0, 2, 1, 3, 4).bfloat16().float(), rtol=2e-2, atol=2e-2)
    later = frames.clone()
    later[:, seen:] = 0  # the frames past 4L-3 are the student's alone
    torch.testing.assert_close(stored, teacher.latents(later).bfloat16().float(), rtol=2e-2, atol=2e-2)

    # Deterministic order, and shards opened lazily in each loader worker (after the fork).
    loader = torch.utils.data.DataLoader(PreparedClips(prepared, SPEC), batch_size=6, num_workers=2)
    batches = list(loader)
    assert torch.equal(torch.cat([b["index"] for b in batches]), torch.arange(20))
    assert torch.equal(torch.cat([b["frames"] for b in batches]),
                       torch.stack([data[i]["frames"] for i in range(20)]))
    assert torch.equal(torch.cat([b["latents"] for b in batches]),
                       torch.stack([data[i]["latents"] for i in range(20)]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_each_window_gets_the_teachers_latents_of_its_frames(videos: Path, tmp_path: Path) -> None:
    """What `jobs.prepare` runs on a GPU: each batch's frames copied on a stream of their own while the
    previous batch encodes, a short last batch padded to the compiled shape, the latents kept on the GPU
    until their shard is written. Every stored window's latents are what the same teacher (compiled, bf16)
    gives for its stored frames one batch at a time: a batch encoded before its copy finished, or with
    another batch's frames, would not be. (The compiled teacher against diffusers' encoder:
    tests/test_teacher.py. Against float32 this tiny random teacher's windows of dark frames differ by up
    to 60 % of their largest latent in bf16, so it is no reference for that.)"""
    out = _mkdir(tmp_path / "prepared")
    settings = PrepareSettings(str(videos), SPEC.frames, SPEC.height, SPEC.width, shard_size=3,
                               teacher_path="random:tiny").validate()
    index_windows(settings).write(out)
    with restored_environ():
        result = PrepareTask(out, {"device": "cuda"}, batch=2)()
    assert result["ok"] and result["windows_stored"] == 20
    data = PreparedClips(out, SPEC)
    frames = torch.stack([data[i]["frames"] for i in range(len(data))]).cuda()
    stored = torch.stack([data[i]["latents"] for i in range(len(data))]).float()
    teacher = load_teacher("hunyuanvideo", "random:tiny").to(torch.device("cuda"), torch.bfloat16)
    teacher.compile()
    expected = torch.cat([teacher.latents(frames[i:i + 2]) for i in range(0, len(frames), 2)]).cpu()
    expected = expected.bfloat16().float()  # as stored
    error = (stored - expected).abs().amax(dim=(1, 2, 3, 4)) / expected.abs().amax(dim=(1, 2, 3, 4))
    assert (error <= 0.01).all(), error


def test_prepared_clips_refuse_bad_folders_in_one_line(prepared: Path, tmp_path: Path) -> None:
    cases = [
        (tmp_path / "nowhere", SPEC, "does not exist"),
        (_mkdir(tmp_path / "empty"), SPEC, "is not a prepared data folder"),
        (prepared, ClipSpec(12, 64, 64),
         "holds 8×64×64 clips (frames×height×width) but the config asks for 12×64×64"),
    ]
    unverified = _mkdir(tmp_path / "unverified")
    shutil.copy(prepared / MANIFEST_FILE, unverified / MANIFEST_FILE)
    cases.append((unverified, SPEC, "taehv prepare --verify --out"))
    for root, spec, needle in cases:
        with pytest.raises(ValueError) as err:
            PreparedClips(root, spec)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_verify_detects_missing_and_misplaced_shards(prepared: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    original = (copy / INDEX_FILE).read_text()
    shard1 = shard_path(copy, 1).read_bytes()
    shard_path(copy, 1).unlink()
    report = verify(copy)
    assert not report.ok and report.missing_shards == [1] and report.missing_windows == [3, 4, 5]
    assert not (copy / INDEX_FILE).exists()  # an index naming a missing shard would mislead the trainer
    assert "INCOMPLETE" in report.table() and "1 shard(s) missing: 1" in report.table()

    shutil.copy(shard_path(copy, 0), shard_path(copy, 1))  # shard 1's file holding shard 0's windows
    meta, _ = read_shard_header(shard_path(copy, 2))  # shard 2 naming other videos: from another preparation
    write_shard(shard_path(copy, 2), load_file(shard_path(copy, 2)),
                {**meta, "rows": json.dumps([["x.mp4", 0]] * 3)})
    report = verify(copy)
    assert report.bad_shards == ["shard 1: holds window(s) 0, 1, 2 that belong to other shards",
                                 "shard 2: its (video, window_start) rows differ from this folder's "
                                 "window list: it comes from another preparation"]
    shutil.copytree(prepared / "shards", copy / "shards", dirs_exist_ok=True)
    shard_path(copy, 1).unlink()

    # The CLI's --verify: exit 1 and the table while incomplete; torch never imported.
    code = ("import sys, runpy; sys.argv=['jobs.prepare','--verify','--out',sys.argv[1]]\n"
            "try:\n    runpy.run_module('jobs.prepare', run_name='__main__')\n"
            "except SystemExit as e:\n    print('EXIT', e.code)\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH')")
    out = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert ("INCOMPLETE" in out.stdout and "EXIT 1" in out.stdout
            and out.stdout.strip().endswith("NO_TORCH")), out
    shard_path(copy, 1).write_bytes(shard1)
    out = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert ": OK" in out.stdout and "EXIT 0" in out.stdout, out
    assert (copy / INDEX_FILE).read_text() == original


def test_prepared_latents_of_another_model_are_refused_at_submit(prepared: Path, tmp_path: Path) -> None:
    """The submit reads the shards with the trainer's reader: a model of other latents, or clips of another
    length, is refused before the queue (exit 2, one line, nothing created)."""
    base = ["--local", "--train", "configs/train/tiny.yaml", "--set", f"job_dir={tmp_path / 'runs'}",
            "--set", "data.source=prepared", "--set", f"data.path={prepared}"]
    cases = {
        "model.latent_channels=8": f"data: {prepared} holds teacher latents of 16 channels, the model has "
                                   "model.latent_channels 8: set model.latent_channels 16, or prepare again "
                                   "with a teacher of that many channels into a new --out",
        "data.frames=12": f"data: ValueError: {prepared} holds 8×64×64 clips (frames×height×width) but "
                          "the config asks for 12×64×64; "}
    for setting, message in cases.items():
        done = cli("jobs.submit", *base, "--set", setting)
        assert done.returncode == 2 and done.stderr.startswith(f"error: {message}"), done.stderr
        assert done.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()
    fine = cli("jobs.submit", *base, "--dry-run")
    assert fine.returncode == 0, fine.stdout[-2000:]
    assert f"PASS    20 prepared clip(s) under {prepared}; read 8 of them" in fine.stdout


def test_a_rerun_writes_only_the_missing_shards(prepared: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    for shard in (2, 5):
        shard_path(copy, shard).unlink()
    # a temporary file (a killed writer's, or a live one's) is neither a finished shard nor a problem
    (copy / "shards" / ".shard_000002.safetensors.tmp-123-abcd").write_bytes(b"partial")
    os.utime(shard_path(copy, 0), (1, 1))  # an old mtime: a rewrite would show
    began = time.time()
    with restored_environ():
        result = PrepareTask(copy, {"device": "cpu", "torch_threads": 1}, batch=2)()
    assert result["shards_written"] == 2 and result["ok"]
    rerun = [e for e in RunFolder(copy / "run").events().read() if e["time"] >= began]
    assert sorted(e["shard"] for e in rerun if e["event"] == "shard") == [2, 5]
    assert [e["step"] for e in rerun if e["event"] == "start"] == [5]  # 5 of 7 shards found done
    assert shard_path(copy, 0).stat().st_mtime == 1
    assert (copy / INDEX_FILE).read_text() == (prepared / INDEX_FILE).read_text()


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """A full disk as this process sees it: writes past `limit` bytes fail with EFBIG."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_shard_that_cannot_be_written_fails_the_run_and_a_rerun_completes(prepared: Path,
                                                                            tmp_path: Path) -> None:
    # Shards are written on a thread while the next is encoded: its error must still stop the run, and
    # no shard may be counted or left half-written.
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    for shard in (2, 5):
        shard_path(copy, shard).unlink()
    size = shard_path(copy, 0).stat().st_size
    message = r"cannot write .*shard_00000\d\.safetensors: .*File too large.*make room there"
    with restored_environ(), file_size_limit(size // 2), pytest.raises(OSError, match=message) as failed:
        PrepareTask(copy, {"device": "cpu", "torch_threads": 1}, batch=2)()
    assert len(str(failed.value).splitlines()) == 1
    assert not shard_path(copy, 2).exists() and not shard_path(copy, 5).exists()
    assert not list((copy / "shards").glob(".shard_*"))  # the temporary file is removed
    with restored_environ():
        result = PrepareTask(copy, {"device": "cpu", "torch_threads": 1}, batch=2)()
    assert result["ok"] and result["shards_written"] == 2 and result["shards_done"] == 7


def test_a_signalled_shard_is_finished_only_when_that_fits() -> None:
    # (windows done, of, seconds so far, seconds since the signal, budget) → abandon?
    assert should_abandon(0, 32, 0.0, 0.0, 100.0)  # nothing invested: stop at once
    assert not should_abandon(16, 32, 4.0, 1.0, 12.5)  # 4 s more (6 s with margin) fit in 11.5 s
    assert should_abandon(16, 32, 8.0, 1.0, 12.5)  # 8 s more (12 s with margin) do not
    assert should_abandon(31, 32, 31.0, 12.0, 12.5)  # the budget is spent


def test_cli_dry_run_imports_no_torch_and_bad_input_is_one_line(prepared: Path, videos: Path,
                                                                 tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cluttered = _mkdir(tmp_path / "cluttered")
    (cluttered / "notes.txt").write_text("x")
    tiny = ["--teacher-path", "random:tiny", "--frames", "8", "--height", "64", "--width", "64",
            "--shard-size", "3"]
    job = ["--cluster", "configs/cluster/testbed.yaml", "--nodes", "2", "--gpus-per-node", "1",
           "--set", f"job_dir={tmp_path}"]
    cases = {
        "dry_new": ["--data", str(videos), "--out", str(tmp_path / "new"), *tiny, *job, "--dry-run"],
        "dry_resume": ["--data", str(videos), "--out", str(prepared), *tiny, *job, "--dry-run"],
        "no_data": ["--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), *tiny],
        "no_videos": ["--data", str(_mkdir(tmp_path / "no_videos")), "--out", str(tmp_path / "o"), *tiny],
        "bad_teacher": ["--data", str(videos), "--out", str(tmp_path / "o"), *tiny,
                        "--teacher-path", str(tmp_path / "vae")],
        "out_is_file": ["--data", str(videos), "--out", str(a_file), *tiny],
        "out_cluttered": ["--data", str(videos), "--out", str(cluttered), *tiny],
        "other_settings": ["--data", str(videos), "--out", str(prepared), *tiny, "--frames", "12"],
        "train_key": ["--data", str(videos), "--out", str(tmp_path / "o"), *tiny, "--set", "optim.lr=1"],
    }
    # One interpreter runs every case: it shows that none of them imports torch.
    code = ("import contextlib, io, json, sys\nfrom taehv_slurm.cli.prepare import main\nresults = {}\n"
            "for name, argv in json.loads(sys.argv[1]).items():\n"
            "    out, err = io.StringIO(), io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
            "        code = main(argv)\n"
            "    results[name] = [code, out.getvalue(), err.getvalue()]\n"
            "results['torch'] = 'torch' in sys.modules\nprint(json.dumps(results))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert results.pop("torch") is False
    code, out, _ = results.pop("dry_new")
    assert (code == 0 and "7 video files" in out and "#SBATCH --nodes=2" in out
            and "#SBATCH --job-name=taehv-testbed-prepare" in out)
    code, out, _ = results.pop("dry_resume")
    assert code == 0 and "7 of 7 shards done" in out
    expected = {
        "no_data": "does not exist or is not a folder",
        "no_videos": "holds no .mp4/.webm/.mkv/.mov files",
        "bad_teacher": "no diffusers VAE there (no config.json)",
        "out_is_file": "is a file, not a folder",
        "out_cluttered": "is not empty and holds no preparation",
        "other_settings": "was prepared with other settings (frames 8 → 12; stride 8 → 12)",
        "train_key": "jobs.prepare takes cluster keys only",
    }
    for name, needle in expected.items():
        code, out, err = results[name]
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, (name, err)
    # bad input and dry runs write nothing
    assert not (tmp_path / "o").exists() and not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------- on the testbed


def shard_events(run_dir: Path) -> list[dict]:
    return [e for e in RunFolder(run_dir).events().read() if e["event"] == "shard"]


def local_prepare(videos: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jobs.prepare", "--data", str(videos), "--out", str(tmp_path / "out"),
            "--teacher-path", "random:tiny", "--frames", "8", "--height", "64", "--width", "64",
            "--stride", "1", "--shard-size", "4", "--batch", "2", "--local", "--set", f"job_dir={tmp_path}",
            *extra]


def stopped_after_the_first_shard(argv: list[str], tmp_path: Path, stop: signal.Signals) -> tuple[int, str]:
    """`argv` run as from a terminal, `stop` sent to the command once a shard is written: (exit, output)."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: [e for p in tmp_path.glob("prepare-*/") for e in shard_events(p)],
                 300, "the first shard", poll_s=0.05)
        proc.send_signal(stop)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, output


def test_sigterm_stops_a_local_prepare_and_the_command_resumes(videos: Path, tmp_path: Path) -> None:
    # `kill`, `timeout` or a stopping container signal only the command (the ranks run in their own
    # session): the job must stop with its finished shards kept, not go on without anyone following it.
    argv = local_prepare(videos, tmp_path)
    code, output = stopped_after_the_first_shard(argv, tmp_path, signal.SIGTERM)
    assert code == 143, output[-3000:]  # docs/errors.md's exit codes
    assert "terminated (SIGTERM): every rank saves" in output and "ended: CANCELLED" in output
    assert "stopped: the shards written are kept" in output and "Ctrl-C" not in output
    kept = len(list((tmp_path / "out").glob("shards/*")))
    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming {tmp_path / 'out'}: " in again.stdout and "ended: COMPLETED" in again.stdout
    assert kept > 0 and "0 missing, 0 bad" in again.stdout


def test_ctrl_c_stops_a_local_prepare(videos: Path, tmp_path: Path) -> None:
    code, output = stopped_after_the_first_shard(local_prepare(videos, tmp_path), tmp_path, signal.SIGINT)
    assert code == 130, output[-3000:]
    assert "interrupted: every rank saves" in output and "(Ctrl-C again to end it without saving)" in output
    assert "ended: CANCELLED" in output and "stopped: the shards written are kept" in output


def test_a_local_prepare_whose_disk_fills_fails_with_exit_1(videos: Path, tmp_path: Path) -> None:
    # A full disk from outside: every process of the command (the controller, the ranks) inherits a limit
    # on the size of the files it writes: the index and the logs fit under it, a shard does not.
    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    done = subprocess.run(local_prepare(videos, tmp_path, "--set", "requeue_on_failure=false"), cwd=REPO,
                          capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ended: FAILED" in done.stdout and "Traceback" not in done.stdout + done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]  # the cause, once
    assert line.startswith("error: OSError: cannot write ") and "File too large" in line, done.stderr


@pytest.mark.usefixtures("slurm_cluster")
def test_two_node_job_preempted_once_then_training_from_the_shards(videos: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 96×96 windows every frame (stride 1): ~120 windows, enough work that the requeue lands mid-run.
    argv = [sys.executable, "-m", "jobs.prepare", "--data", str(videos), "--out", str(out),
            "--teacher-path", "random:tiny", "--frames", "8", "--height", "96", "--width", "96",
            "--stride", "1", "--shard-size", "4", "--batch", "2",
            "--cluster", "configs/cluster/testbed.yaml", "--nodes", "2", "--gpus-per-node", "1",
            "--set", f"job_dir={tmp_path / 'runs'}", "--name", "prep", "--follow"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        while not any(line.startswith("submitted job") for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        job_id = lines[-1].split()[2].rstrip(":")
        run_dir = tmp_path / "runs" / "prep"
        wait_for(lambda: shard_events(run_dir), 300, "the first shard", poll_s=0.05)
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        rest, _ = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-4000:]
    assert f"job {job_id} ended: COMPLETED" in output and "unreadable 1" in output

    events = RunFolder(run_dir).events().read()
    starts = [e for e in events if e["event"] == "start"]
    requeues = [e for e in events if e["event"] == "requeue"]
    assert [e["reason"] for e in requeues] == ["preempted"] and len(starts) == 2
    written = shard_events(run_dir)
    num_shards = starts[0]["shards"]
    first = {e["shard"] for e in written if e["segment"] == 0}
    assert 0 < len(first) < num_shards, "the requeue must land after the first shard and before the last"
    assert (starts[1]["step"] == requeues[0]["step"] == len(first)
            and starts[1]["remaining"] == num_shards - len(first))
    assert sorted(e["shard"] for e in written) == list(range(num_shards))  # each shard written exactly once
    assert {e["rank"] for e in written} == {0, 1}
    restarted = starts[1]["time"]
    for shard in first:  # not rewritten after the restart
        assert shard_path(out, shard).stat().st_mtime < restarted

    clips = VideoFolderClips(videos, ClipSpec(8, 96, 96), stride=1)
    index = pd.read_csv(out / INDEX_FILE)
    assert list(zip(index.video, index.window_start)) == [(relative(p, videos), s) for p, s in clips.windows]
    assert len(index) == len(clips) == 136 and index.shard.nunique() == num_shards == 34
    assert verify(out).ok

    # Train from the shards: stored latents are the teacher targets (no teacher in the job).
    train = tiny_train(steps=3, **{"data.source": "prepared", "data.path": str(out), "data.height": 96,
                                   "data.width": 96, "teacher.kind": "none", "teacher.path": None,
                                   "intervals.log_every": 1, "intervals.val_every": 3, "data.val_clips": 2})
    handle = submit_training(make_cluster(tmp_path / "runs", nodes=1, gpus_per_node=1), train, "train")[0]
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(60)
    rows = [r for r in metrics(handle.run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["latent_loss"] > 0 for r in rows)
