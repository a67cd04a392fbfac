"""Python's garbage collector across a rank's start (taehv_slurm/runtime/collector.py): off while the start
imports and builds, what it made frozen once the task's state is loaded, and never touched in a process no
entry point started. The real entry point in a process of its own, no Slurm.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from submitit.helpers import DelayedSubmission

from taehv_slurm.backends import LocalBackend
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.common.security import make_private_dir, private_umask
from taehv_slurm.runtime.context import RunContext
from taehv_slurm.runtime.requeue import RequeueableTask
from taehv_slurm.runtime.tasks import TaskRef
from tests.helpers import LOCAL_TASK_ENV
from tests.tasks import ReportsCollector


@pytest.mark.parametrize("named", [True, False], ids=["named-task", "users-callable"])
def test_a_rank_starts_with_the_collector_off_and_collects_once_its_state_is_loaded(tmp_path: Path,
                                                                                    named: bool) -> None:
    # The entry point turns Python's garbage collector off for the start's imports (a quick rank's CPU to
    # its first step: 4.2–4.5 → 2.9–3.1 s); `ctx.started` freezes what the start made and turns it on for
    # the rest of the run. A task named by TaskRef (the trainer, prepare) begins with it off; a user's own
    # callable finds it on.
    run_dir = make_private_dir(tmp_path / "run")
    folder = make_private_dir(RunFolder(run_dir).submitit)
    out = tmp_path / "collector.json"
    task = TaskRef("tests.tasks:ReportsCollector", out=str(out)) if named else ReportsCollector(str(out))
    with private_umask():
        DelayedSubmission(RequeueableTask(task, run_dir, backend=LocalBackend())).dump(
            folder / "4242_submitted.pkl")
    entry = subprocess.run([sys.executable, "-m", "taehv_slurm.runtime.entry", str(folder)], text=True,
                           capture_output=True, env={**os.environ, **LOCAL_TASK_ENV}, timeout=120)
    assert entry.returncode == 0, entry.stdout[-2000:] + entry.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["began"], report["started"]) == (not named, True)
    assert report["frozen"] > 10_000  # the start's modules and objects, out of every later collection


def test_a_task_called_in_a_users_own_process_leaves_its_collector_as_it_was(tmp_path: Path) -> None:
    # A notebook's process, say: no entry point paused the collector, so `ctx.started` neither turns it on
    # nor freezes the user's objects.
    ctx = RunContext.standalone(tmp_path / "run")
    frozen = gc.get_freeze_count()
    gc.disable()
    try:
        ctx.started(0)
        assert not gc.isenabled()
    finally:
        gc.enable()
    ctx.started(0)
    assert gc.isenabled() and gc.get_freeze_count() <= frozen  # nothing frozen (frozen objects may be freed)
