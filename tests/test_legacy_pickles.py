"""A job queued under the old module names (earlier 0.1.0 code) still runs after an update: its pickle names
the old modules (`trainer.train.TrainTask`, `taehv_slurm.requeue.RequeueableTask`, no backend object), and the
entry point resolves them (taehv_slurm/runtime/legacy.py) — even beside a user's own `trainer.py`. A job_dir
and a job pickle the code before 0.2's layout wrote (tests/fixtures/job_dir_before_0_2/) still read, resume
and load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.common.security import make_private_dir
from tests.helpers import LOCAL_TASK_ENV, REPO, tiny_train

# Written the way the old code wrote it: the classes pickled by reference under their old module names.
PICKLE_AS_0_1 = """
import json, sys, types
from submitit.helpers import DelayedSubmission
import taehv_slurm.runtime.requeue as requeue
import taehv_slurm.trainer.task as task
sys.modules["trainer"] = types.ModuleType("trainer")
sys.modules["trainer.train"] = task
sys.modules["taehv_slurm.requeue"] = requeue
task.TrainTask.__module__ = "trainer.train"
requeue.RequeueableTask.__module__ = "taehv_slurm.requeue"
train, run_dir, pickle = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
wrapped = requeue.RequeueableTask(task.TrainTask(train, {"device": "cpu", "torch_threads": 1}), run_dir)
del wrapped.backend  # the old code read the backend from SUBMITIT_EXECUTOR when the job ran
DelayedSubmission(wrapped).dump(pickle)
"""

# What the entry point does before submitit loads a pickle (legacy.install), then which backend it got.
BACKEND_OF_0_1_PICKLE = """
import pickle, sys
from taehv_slurm.runtime import legacy
legacy.install()
with open(sys.argv[1], "rb") as f:
    task = pickle.load(f).function
print(type(task).__name__, type(task.backend).__name__)
"""


def test_a_job_pickled_by_0_1_runs_after_the_upgrade(tmp_path: Path) -> None:
    run_dir = make_private_dir(tmp_path / "run")
    folder = make_private_dir(RunFolder(run_dir).submitit)
    pickle = folder / "4242_submitted.pkl"
    train = tiny_train(steps=2, **{"intervals.log_every": 1, "intervals.val_every": 2}).to_dict()
    subprocess.run([sys.executable, "-c", PICKLE_AS_0_1, json.dumps(train), str(run_dir), str(pickle)],
                   check=True, cwd=REPO, timeout=120)
    data = pickle.read_bytes()
    assert (b"trainer.train" in data and b"taehv_slurm.requeue" in data
            and b"taehv_slurm.trainer.task" not in data)

    # The backend object an old task gets is the one named by the executor it runs under.
    for executor, backend in (("slurm", "SlurmBackend"), ("local", "LocalBackend"), ("", "DirectBackend")):
        loaded = subprocess.run([sys.executable, "-c", BACKEND_OF_0_1_PICKLE, str(pickle)], cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": str(REPO), "SUBMITIT_EXECUTOR": executor},
                                capture_output=True, text=True, timeout=120)
        assert loaded.stdout.split() == ["RequeueableTask", backend], loaded.stdout + loaded.stderr

    (tmp_path / "trainer.py").write_text("raise RuntimeError('the user trainer.py was imported')\n")
    env = {**os.environ, **LOCAL_TASK_ENV, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "taehv_slurm.runtime.entry", str(folder), str(run_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kinds = [e["event"] for e in RunFolder(run_dir).events().read()]
    assert kinds[0] == "start" and kinds[-1] == "finished" and "failure" not in kinds
    assert (RunFolder(run_dir).checkpoints / "step_00000002" / "state.pt").is_file()


# The code before the shared layer's move pickled a cluster config under its old module name.
PICKLE_BEFORE_THE_MOVE = """
import pickle, sys
from taehv_slurm.common.config import load_cluster
cluster = load_cluster("configs/cluster/testbed.yaml")
type(cluster).__module__ = "taehv_slurm.config"
sys.stdout.buffer.write(pickle.dumps(cluster))
"""

# In a fresh process: each old name is the module now at its new name, with its own spec; the pickle loads.
LOAD_UNDER_THE_OLD_NAMES = """
import importlib, pickle, sys
from taehv_slurm.common.moved import MOVED
for old, new in MOVED.items():
    module = importlib.import_module(old)
    assert module is importlib.import_module(new) and module.__spec__.name == new, (old, module.__spec__)
cluster = pickle.loads(sys.stdin.buffer.read())
print(type(cluster).__module__, cluster.job_dir)
"""


def test_modules_moved_into_the_shared_layer_still_load_under_their_old_names(tmp_path: Path) -> None:
    """A user's `from taehv_slurm.config import ...` and a job pickled before the move keep working."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pickled = subprocess.run([sys.executable, "-c", PICKLE_BEFORE_THE_MOVE], cwd=REPO, env=env,
                             capture_output=True, check=True, timeout=120).stdout
    assert b"taehv_slurm.config" in pickled and b"taehv_slurm.common.config" not in pickled
    loaded = subprocess.run([sys.executable, "-c", LOAD_UNDER_THE_OLD_NAMES], input=pickled, cwd=tmp_path,
                            env=env, capture_output=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr.decode()[-3000:]
    module, job_dir = loaded.stdout.decode().split()
    assert module == "taehv_slurm.common.config" and job_dir


# A job_dir as the code before the move wrote it (45544a0; tests/fixtures/job_dir_before_0_2/README.md).
BEFORE_THE_MOVE = REPO / "tests" / "fixtures" / "job_dir_before_0_2"
ITS_SETTINGS = ("intervals.log_every=1", "intervals.ckpt_every=2", "intervals.val_every=2",
                "intervals.keep_checkpoints=1", "model.encoder_width=8", "model.decoder_widths=[8,8,8,8]")
ITS_TRAIN_FLAGS = ["--train", "configs/train/tiny.yaml", "--name", "before-0-2",
                   *(flag for setting in ITS_SETTINGS for flag in ("--set", setting))]


def test_a_job_dir_written_before_the_move_reads_and_resumes(tmp_path: Path) -> None:
    """Status, the handle's metrics and a resume by name work on the old files, moved to another folder."""
    from taehv_slurm.handle import JobHandle

    job_dir = shutil.copytree(BEFORE_THE_MOVE, tmp_path / "moved-job-dir")
    taehv = [sys.executable, "-m", "taehv_slurm"]
    status = subprocess.run([*taehv, "status", "before-0-2", "--job-dir", str(job_dir)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    row = status.stdout.splitlines()[1].split()
    assert row[:2] == ["7852-tplkwm", "before-0-2"] and "COMPLETED" in row and "4/4" in row, status.stdout
    handle = JobHandle.attach("before-0-2", job_dir)
    assert handle.run_dir == job_dir / "before-0-2" and handle.last_step() == 4
    assert handle.metrics().query("event == 'train'")["step"].tolist() == [1, 2, 3, 4]

    resumed = subprocess.run([*taehv, "submit", "--local", *ITS_TRAIN_FLAGS, "--set", "steps=6", "--set",
                              f"job_dir={job_dir}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    starts = [e for e in RunFolder(job_dir / "before-0-2").events().read() if e["event"] == "start"]
    assert [(e["job_id"], e["step"]) for e in starts][0] == ("7852-tplkwm", 0)
    assert [e["step"] for e in starts][1:] == [4], starts  # the new job began at the old checkpoint
    again = JobHandle.attach("before-0-2", job_dir)
    assert again.job_id != "7852-tplkwm" and again.last_step() == 6
    assert again.metrics().query("event == 'train'")["step"].tolist() == [1, 2, 3, 4, 5, 6]


# The entry point's steps before submitit runs a pickle (legacy.install), then what the old pickle holds.
OLD_PICKLE_LOADS = """
import pickle, sys
from taehv_slurm.runtime import legacy
legacy.install()
with open(sys.argv[1], "rb") as f:
    task = pickle.load(f).function
runtime, built = task.task.kwargs["runtime"], task.task.build()
print(type(task).__name__, type(runtime).__module__, type(built).__module__, type(task.backend).__name__,
      task.run_dir)
"""


def test_a_job_pickle_written_before_the_move_loads_as_the_current_classes(tmp_path: Path) -> None:
    pickle = next((BEFORE_THE_MOVE / "before-0-2" / "submitit").glob("*_submitted.pkl"))
    assert b"taehv_slurm.config" in pickle.read_bytes() and b"taehv_slurm.common" not in pickle.read_bytes()
    loaded = subprocess.run([sys.executable, "-c", OLD_PICKLE_LOADS, str(pickle)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "SUBMITIT_EXECUTOR": "local"},
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == ["RequeueableTask", "taehv_slurm.common.config",
                                     "taehv_slurm.trainer.task", "LocalBackend",
                                     "/tmp/taehv-0.1-job-dir/before-0-2"]
