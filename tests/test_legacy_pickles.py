"""A job queued under the old module names (earlier 0.1.0 code) still runs after an update: its pickle names
the old modules (`trainer.train.TrainTask`, `taehv_slurm.requeue.RequeueableTask`, no backend object), and the
entry point resolves them (taehv_slurm/runtime/legacy.py) — even beside a user's own `trainer.py`."""

from __future__ import annotations

import json
import os
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
