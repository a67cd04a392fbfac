"""Fail before the queue: `jobs.submit` checks what the job will need, as a user types it.

Every refusal: exit 2, one `error:` line per problem naming the fix, nothing submitted (no new job in
squeue or sacct on the Slurm testbed), and the job folder unchanged (no run folder, registry or lock).
`--dry-run` shows the same checks as PASS/WARN/FAIL rows. Then what a run records across attempts (the
resolved config, what changed, the code and versions), and run files read as input: damaged lines, a
job folder others can write, a file another user put there.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.faults import wait_for
from bench.videos import write_garbage, write_video
from taehv_slurm.common.runfolder import JobDir
from taehv_slurm.handle import JobHandle
from taehv_slurm.runtime.provenance import commit_label
from tests.helpers import REPO, cli, documented

TINY = ["--train", "configs/train/tiny.yaml", "--set", "teacher.kind=none"]
SHORT = ["--set", "steps=4", "--set", "intervals.log_every=2", "--set", "intervals.ckpt_every=2"]
NOBODY = 65534  # the uid of `nobody`: "another user" for the planted files


def local(job_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return cli("jobs.submit", "--local", *TINY, "--set", f"job_dir={job_dir}", *args)


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under `folder` with its content's hash (folders: their mode): what a refusal must keep."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
                                         else oct(p.stat().st_mode))
            for p in sorted(folder.rglob("*"))}


def errors(done: subprocess.CompletedProcess) -> list[str]:
    lines = done.stderr.strip().splitlines()
    assert all(line.startswith("error: ") for line in lines), done.stderr  # no traceback, nothing else
    return [line.removeprefix("error: ") for line in lines]


def check_rows(done: subprocess.CompletedProcess) -> dict[str, list[tuple[str, str]]]:
    """The --dry-run's check table: check → [(result, detail)]."""
    lines = done.stdout.split("\nchecks:\n", 1)[1].splitlines()[2:]
    rows: dict[str, list[tuple[str, str]]] = {}
    for line in lines:
        if not re.match(r"\S.*?\s{2,}(PASS|WARN|FAIL|SKIP)\s{2,}", line):
            break  # the table's end: the lines after it
        check, result, detail = re.split(r"\s{2,}", line, maxsplit=2)
        rows.setdefault(check, []).append((result, detail))
    return rows


@pytest.fixture
def videos(tmp_path: Path) -> dict[str, Path]:
    """A missing, an empty and an undecodable video folder, and a good one."""
    folders = {name: tmp_path / name for name in ("missing", "empty", "broken", "good")}
    folders["empty"].mkdir()
    folders["broken"].mkdir()
    for i in range(3):
        write_garbage(folders["broken"] / f"clip{i}.mp4")
    folders["good"].mkdir()
    write_video(folders["good"] / "clip.mp4", 16, 64, 64)
    return folders


def test_bad_data_is_refused_before_anything_is_written(tmp_path: Path, videos: dict[str, Path]) -> None:
    job_dir = tmp_path / "runs"
    job_dir.mkdir(mode=0o700)
    expected = {
        "missing": documented("submit-data-missing", tmp_path).removeprefix("error: "),
        "empty": f"data: ValueError: video folder '{videos['empty']}' holds no .mp4/.webm/.mkv/.mov files; "
                 "add videos there or pass another folder / extensions",
        "broken": f"data: none of 3 sampled file(s) under {videos['broken']} decodes a 8-frame window: ",
    }
    for name, message in expected.items():
        before = snapshot(job_dir)
        done = local(job_dir, *on_videos(videos[name]), "--name", name)
        assert done.returncode == 2, done.stdout + done.stderr
        (line,) = errors(done)
        assert line.startswith(message), line
        assert snapshot(job_dir) == before and not (job_dir / name).exists()
        shown = local(job_dir, *on_videos(videos[name]), "--name", name, "--dry-run")
        assert shown.returncode == 2 and check_rows(shown)["data"][0][0] == "FAIL"
        assert snapshot(job_dir) == before
    # the documented switch: the login node cannot see the data; the job checks at start-up
    skipped = local(job_dir, *on_videos(videos["missing"]), "--skip-data-checks", "--dry-run")
    assert skipped.returncode == 0 and check_rows(skipped)["data"][0][0] == "SKIP"
    good = local(job_dir, *on_videos(videos["good"]), "--dry-run")
    ((result, detail),) = check_rows(good)["data"]
    assert good.returncode == 0 and result == "PASS" and "1 of 1 sampled decode a 8×64×64 window" in detail


def test_every_problem_of_a_submit_at_once(tmp_path: Path) -> None:
    job_dir = tmp_path / "runs"
    huge = ["data.frames=48", "data.height=720", "data.width=1280", "batch.per_gpu=8", "batch.effective=16"]
    done = local(job_dir, *on_videos(tmp_path / "nope"), *[a for kv in huge for a in ("--set", kv)],
                 "--name", "big")
    assert done.returncode == 2
    lines = errors(done)
    assert [line.split(":")[0] for line in lines] == ["host memory", "data"]
    assert "per node for 2 rank(s) (estimate) but this machine has" in lines[0]
    assert lines[0].endswith("lower batch.per_gpu, data.height/width or the ranks per node")
    assert not job_dir.exists()  # not even the job folder


def test_the_shipped_gpu_config_on_a_machine_without_one_names_the_cpu_config(tmp_path: Path) -> None:
    # `taehv submit --local` as typed, from an empty folder of a machine without a GPU (the batch raised so
    # that any machine's memory is too small); the fix it prints then runs.
    job_dir = tmp_path / "runs"
    done = cli("jobs.submit", "--local", "--set", f"job_dir={job_dir}", "--set", "batch.per_gpu=1024",
               "--skip-data-checks", cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    (line,) = errors(done)
    assert line.startswith("host memory: ") and line.endswith(
        "or the ranks per node, or train the CPU-sized config: --train configs/train/tiny.yaml"), line
    assert not job_dir.exists()
    printed_fix = line.rsplit(": ", 1)[1].split()  # run as printed
    fixed = cli("jobs.submit", "--local", *printed_fix, "--set", f"job_dir={job_dir}", "--dry-run",
                cwd=tmp_path)
    assert fixed.returncode == 0 and check_rows(fixed)["host memory"][0][0] == "PASS"


def test_names_machines_and_config_files(tmp_path: Path) -> None:
    job_dir = tmp_path / "runs"
    done = local(job_dir, "--name", "../../escape")
    assert done.returncode == 2 and done.stderr.strip() == documented("run-name")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    done = cli("jobs.submit", "--local", "--train", str(empty), "--set", f"job_dir={job_dir}")
    assert done.returncode == 2 and done.stderr.strip() == documented("required-keys", tmp_path)
    if not list(Path("/dev").glob("nvidia[0-9]*")):  # a machine without GPUs, as CI
        done = cli("jobs.submit", "--local", "--cluster", "configs/cluster/h100_8gpu.yaml", *TINY,
                   "--set", f"job_dir={job_dir}")
        assert done.returncode == 2 and done.stderr.strip() == documented("local-without-gpus")
    assert not job_dir.exists()


@pytest.mark.usefixtures("slurm_cluster")
def test_on_slurm_nothing_reaches_the_queue(tmp_path: Path) -> None:
    job_dir = tmp_path / "runs"
    done = cli("jobs.submit", "--cluster", "configs/cluster/testbed.yaml", *TINY, "--nodes", "1",
               "--set", f"job_dir={job_dir}", *on_videos(tmp_path / "nope"), "--name", "queued")
    assert done.returncode == 2
    assert [line.split(":")[0] for line in errors(done)] == ["data"]
    assert jobs_writing_under(job_dir) == [] and not job_dir.exists()


def test_a_dry_run_with_no_slurm_checks_the_rest_as_on_a_login_node(tmp_path: Path) -> None:
    """README's cluster block on a laptop: no Slurm commands on PATH, or a SLURM_CONF that names no file.
    The plan, the sbatch script and every check that needs no Slurm come as on a login node; the rows that
    need Slurm say so; the exit code is that of the rows checked. A submit itself still refuses in one
    line, and nothing is written."""
    base = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    laptops = {"no Slurm commands": {**base, "PATH": str(tmp_path / "bin")},
               "no slurm.conf": {**base, "SLURM_CONF": str(tmp_path / "nowhere.conf")}}
    dry = ["jobs.submit", "--cluster", "configs/cluster/h100_8gpu.yaml", "--nodes", "8", "--dry-run"]
    for laptop, env in laptops.items():
        # the shipped configs/train/taehv.yaml trains on data/prepared, which this folder lacks
        done = cli(*dry, cwd=tmp_path, env=env)
        assert done.returncode == 2, (laptop, done.stdout[-2000:] + done.stderr)
        assert "#SBATCH --nodes=8" in done.stdout and "effective batch     128 = 64 ranks × 2" in done.stdout
        rows = check_rows(done)
        assert rows["data"][0][0] == "FAIL" and "prepared data folder data/prepared does not exist" in \
            rows["data"][0][1]
        assert [r for r, _ in rows["GPU memory"] + rows["host memory"] + rows["resume"]] == ["PASS"] * 3
        (why,) = rows["Slurm"]
        assert why[0] == "SKIP" and why[1].startswith("no Slurm here" if "commands" in laptop
                                                      else f"SLURM_CONF={tmp_path / 'nowhere.conf'} names no")
        for check in ("partition", "GPUs (gres)", "CPUs", "nodes", "accounting", "requeue"):
            ((result, detail),) = rows[check]
            assert result == "SKIP" and detail.startswith("not checked here (no Slurm): "), (check, detail)
        assert done.stdout.rstrip().endswith("a submit would be refused: check data failed (nothing was "
                                             "submitted)")
        skipped = cli(*dry, "--skip-data-checks", cwd=tmp_path, env=env)
        assert skipped.returncode == 0, skipped.stdout[-2000:] + skipped.stderr
        assert ("on a login node, `python -m jobs.preflight --cluster configs/cluster/h100_8gpu.yaml "
                "--nodes 8` checks the rows not checked here") in skipped.stdout
        submit = cli(*dry[:-1], "--skip-data-checks", cwd=tmp_path, env=env)
        assert submit.returncode == 2 and submit.stderr.count("\n") == 1 and "SLURM" in submit.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def jobs_writing_under(folder: Path) -> list[str]:
    """Slurm's jobs, queued, running or ended in the last MinJobAge (300 s on the testbed), whose output
    or script lies under `folder` (other tests' jobs share the testbed)."""
    shown = subprocess.run(["scontrol", "-o", "show", "jobs"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in shown.stdout.splitlines() if str(folder) in line]


def dirty_checkout(folder: Path) -> tuple[Path, str]:
    """The package, its command shims and configs as a git work tree of their own with an uncommitted
    change (as a user's checkout often is): (the tree, its HEAD commit)."""
    for part in ("taehv_slurm", "jobs", "configs"):
        shutil.copytree(REPO / part, folder / part, ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the user's code"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    with open(folder / "taehv_slurm" / "__init__.py", "a") as f:
        f.write("# a change the user has not committed\n")
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout
    return folder, head.strip()


def test_a_resume_shows_what_changed_refuses_another_model_and_records_each_attempt(tmp_path: Path) -> None:
    """Run from a checkout with an uncommitted change: each attempt records that commit, dirty, and the
    diff; a resume lists what changed and refuses another model shape or teacher."""
    job_dir = tmp_path / "runs"
    checkout, head = dirty_checkout(tmp_path / "checkout")

    def submit(*args: str) -> subprocess.CompletedProcess:
        return cli("jobs.submit", "--local", "--set", f"job_dir={job_dir}", *SHORT, "--name", "r1", *args,
                   cwd=checkout, env={"PYTHONPATH": str(checkout)})

    first = submit(*TINY)
    assert first.returncode == 0, first.stdout + first.stderr
    again = submit(*TINY, "--set", "steps=6", "--set", "optim.lr=2e-3")
    assert again.returncode == 0, again.stdout + again.stderr
    shown = [line for line in again.stdout.splitlines() if line.startswith("changed: ")]
    assert "\n".join(shown) == documented("resume-changed")
    note = "the lr schedule is recomputed for the new value from the resumed step on"
    before = snapshot(job_dir)
    wider = submit(*TINY, "--set", "steps=8", "--set", "model.encoder_width=32")
    assert wider.returncode == 2 and wider.stderr.strip() == documented("resume-refused")
    other_teacher = submit("--train", "configs/train/tiny.yaml", "--set", "steps=8")  # tiny.yaml's teacher
    assert other_teacher.returncode == 2 and other_teacher.stderr.strip() == (
        "error: resume: r1: teacher.kind: its checkpoint (step 6) was trained with 'none', the config now "
        "says 'hunyuanvideo'; set it back (--set teacher.kind=none) or start a new run (another --name)")
    assert snapshot(job_dir) == before
    history = JobHandle.attach("r1", job_dir).config_history()
    assert list(history["step"]) == [0, 4] and list(history["optim.lr"]) == [1e-3, 2e-3]
    assert history["changed"].iloc[1] == f"steps: 4 → 6 ({note}); optim.lr: 0.001 → 0.002 ({note})"
    diff = subprocess.run(["git", "-C", str(checkout), "diff", "HEAD"], check=True, capture_output=True,
                          text=True).stdout
    for _, attempt in history.iterrows():  # provenance of both attempts: the checkout's commit and change
        assert (attempt["commit"], attempt["dirty"]) == (head, True)
        assert (job_dir / "r1" / attempt["diff_file"]).read_text() == diff.strip()
        assert attempt["python"] and attempt["torch"] and attempt["submitit"] and attempt["hosts"]
    status = cli("jobs.status", "r1", "--job-dir", str(job_dir), "--format", "json")
    (row,) = json.loads(status.stdout)
    assert row["commit"] == f"{head[:8]}+dirty"
    # each job's row shows its own step, not the run's newest (the first job ended at 4 of its 4)
    rows = [json.loads(cli("jobs.status", str(job), "--job-dir", str(job_dir), "--format", "json").stdout)[0]
            for job in history["job_id"]]
    assert [(r["step"], r["steps"]) for r in rows] == [(4, 4), (6, 6)]


def test_a_commit_that_changed_between_attempts_is_flagged() -> None:
    attempts = [{"code": {"commit": "a" * 40, "dirty": False}}, {"code": {"commit": "a" * 40, "dirty": True}},
                {"code": {"commit": "b" * 40, "dirty": False}}]
    assert commit_label(attempts[:1]) == "aaaaaaaa"
    assert commit_label(attempts) == "aaaaaaaa→bbbbbbbb"
    assert commit_label([{"code": {"tree": None}}]) is None  # an installed wheel: no commit to show


def test_a_damaged_registry_beside_a_live_job(tmp_path: Path) -> None:
    job_dir = tmp_path / "runs"
    live = subprocess.Popen([*cli_args(job_dir), "--set", "steps=100000", "--name", "live"], cwd=REPO,
                            env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        registry = JobDir(job_dir).registry
        wait_for(lambda: registry.exists() and "live" in registry.read_text(), 120, "the live job's record")
        with open(registry, "ab") as f:
            f.write(b"\xff\xfe junk \x00\n")
            f.write(json.dumps({"event": "submitted", "run": "x"}).encode() + b"\n")  # no job_id, no folder
            f.write(b'{"event": "submitted", "job_id": "9')  # cut short by a kill mid-write
        status = cli("jobs.status", "--job-dir", str(job_dir))
        assert status.returncode == 0
        # the last line, without its end, may be a record still being written: not judged yet
        assert status.stderr.strip() == documented("damaged-registry", tmp_path).replace(
            "3 damaged line(s) (line 2, 3, 4:", "2 damaged line(s) (line 2, 3:").replace("other 2", "other 1")
        (row,) = status.stdout.splitlines()[1:]
        assert row.split()[1:3] == ["live", "RUNNING"]
        # the next record starts on a line of its own, after the cut one, which now counts as damaged
        done = local(job_dir, *SHORT, "--name", "after")
        assert done.returncode == 0, done.stderr
        status = cli("jobs.status", "--job-dir", str(job_dir))
        assert status.stderr.strip() == documented("damaged-registry", tmp_path)
        assert [r.split()[1] for r in status.stdout.splitlines()[1:]] == ["live", "after"]
    finally:  # cancelled by id: a Ctrl-C (SIGINT) is lost where the tests run with it ignored (nohup, CI)
        cli("jobs.cancel", "live", "--job-dir", str(job_dir))
        live.wait(120)


def test_a_job_folder_others_can_write_and_a_file_planted_there(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    before = snapshot(shared)
    done = local(shared, *SHORT, "--name", "r")
    assert done.returncode == 2 and done.stderr.strip() == documented("shared-job-dir", tmp_path).replace(
        "alice", getpass.getuser())
    assert snapshot(shared) == before and oct(shared.stat().st_mode & 0o7777) == "0o1777"  # never tightened
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    planted = JobDir(private).registry
    planted.write_text(json.dumps({"event": "submitted", "job_id": "1", "run": "x", "run_dir": "/etc",
                                   "folder": "/etc"}) + "\n")
    os.chown(planted, NOBODY, NOBODY)
    done = local(private, *SHORT, "--name", "r")
    assert done.returncode == 2 and done.stderr.strip() == documented("planted-registry", tmp_path)
    status = cli("jobs.status", "--job-dir", str(private))
    assert status.returncode == 0 and status.stdout.startswith("no runs in")
    assert "belongs to nobody" in status.stderr and planted.read_text().count("\n") == 1  # read by nobody


def on_videos(folder: Path) -> list[str]:
    return ["--set", "data.source=video", "--set", f"data.path={folder}"]


def cli_args(job_dir: Path) -> list[str]:
    return [sys.executable, "-m", "jobs.submit", "--local", *TINY, "--set", f"job_dir={job_dir}",
            "--set", "intervals.log_every=50"]


def user_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                "MASTER_ADDR", "TAEHV_JOB_DIR")},
            "PYTHONPATH": str(REPO)}
