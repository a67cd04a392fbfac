"""What each task runs on the nodes: `python -m taehv_slurm.runtime.entry [--after STATUS] FOLDER [RUN_DIR]`.

First it holds USR2 and SIGTERM (`signals`): a time-limit warning or preemption that arrives
while the task is still starting is kept for the training loop instead of ending the process.

submitit's own entry point loads the pickle it finds in FOLDER without asking who wrote it. This
one then sets an owner-only umask (so every log, metric, TensorBoard file and checkpoint the job
writes is private; group-readable when the cluster config names a group), then refuses a pickle
that another user could have written or replaced — one line naming the path and the fix, exit 2,
nothing deleted — and only then hands over to submitit. RUN_DIR is the folder the run owns (`submit()`
passes its run folder); without it, FOLDER itself (an executor folder made with `make_executor`).

A task that raises exits 1 with its traceback printed once (submitit re-raises what it already logged).
A pickle written under the old module names (earlier 0.1.0 code) still loads (`legacy`).
With `--after STATUS` it runs once more where the ranks were started from, after all of them ended
(the sbatch script's teardown, the local controller): the task's `after_ranks`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

from taehv_slurm.common.security import UnsafePathError, check_safe_to_load, umask_for
from taehv_slurm.runtime import collector, legacy, signals
from taehv_slurm.runtime.bytecode import COMPILE_CACHE_ENV, keep_bytecode

STARTED_ENV = "TAEHV_STARTED_AT"  # when this rank's process began (the run context reads it)
PICKLE_WAIT_S = 60  # the submitting side moves the pickle into place right after sbatch returns
REFUSED_EXIT_CODE = 2


def main(argv: list[str] | None = None) -> None:
    signals.hold()  # first: submitit's import and the pickle's (torch) take seconds
    collector.pause()  # until the task's start is over (taehv_slurm.runtime.collector)
    os.environ.setdefault(STARTED_ENV, repr(time.time()))  # the attempt's start, for its time to first step
    args = list(sys.argv[1:] if argv is None else argv)
    after = None
    if args[:1] == ["--after"] and len(args) > 1:  # where the ranks were started from, once all ended
        after, args = int(args[1]), args[2:]
    if len(args) not in (1, 2):
        sys.exit("usage: python -m taehv_slurm.runtime.entry [--after STATUS] SUBMITIT_FOLDER [RUN_DIR]")
    # Before anything is written (submitit's result pickle, the trainer's files, a requeue's pickle).
    os.umask(umask_for(os.environ.get("TAEHV_SHARED_GROUP") or None))
    keep_bytecode(os.environ.get(COMPILE_CACHE_ENV))  # before the pickle imports torch
    folder = Path(args[0])
    run_dir = Path(args[1]) if len(args) == 2 else folder
    os.environ["SUBMITIT_FOLDER"] = str(folder)
    pickle = checked_pickle(folder, run_dir, refused_exit=after)
    legacy.install()
    if after is not None:
        sys.exit(run_after(pickle, after))
    from taehv_slurm.common.submitit_api import process_job
    from taehv_slurm.runtime.requeue import ReportedError

    try:
        process_job(folder)
    except ReportedError:  # recorded, and printed on this rank already
        sys.exit(1)
    except Exception:  # submitit logged it and wrote it to the result pickle; print it once, exit 1
        traceback.print_exc()
        sys.exit(1)


def checked_pickle(folder: Path, run_dir: Path, refused_exit: int | None = None) -> Path:
    """The job's pickle, once it is there and no other user could have written it (else exit 2). With
    `refused_exit` (the `--after` step) a refusal exits with that status silently: the ranks said it."""
    import submitit

    try:
        pickle = submitit.JobEnvironment().paths.submitted_pickle
    except (RuntimeError, KeyError) as err:
        # not inside a submitit job: no SUBMITIT_EXECUTOR or launcher variables
        detail = f"{err.args[0]} is not set" if isinstance(err, KeyError) else str(err).strip()
        sys.exit(f"[taehv] cannot run {folder}: not inside a job submitted by taehv_slurm ({detail})")
    for _ in range(PICKLE_WAIT_S):
        if pickle.exists():
            break
        time.sleep(1)
    try:
        check_safe_to_load(pickle, run_dir)
    except UnsafePathError as err:
        if refused_exit is not None:
            sys.exit(refused_exit)
        print(f"[taehv] {err}", file=sys.stderr, flush=True)
        sys.exit(REFUSED_EXIT_CODE)
    return pickle


def run_after(pickle: Path, status: int) -> int:
    """After srun (the sbatch script's teardown) or the local controller's ranks ended with `status`: the
    task's `after_ranks` records what the ranks could not say themselves and requeues where that helps.
    A requeue's `scontrol requeuehold` ends this job's processes: SIGTERM is ignored for the moment it
    takes. Returns the backend's requeue code when it requeued, else `status`."""
    import signal

    import cloudpickle

    from taehv_slurm.runtime.requeue import RequeueableTask

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pickle, "rb") as f:
        task = getattr(cloudpickle.load(f), "function", None)
    if not isinstance(task, RequeueableTask):
        return status
    log = pickle.with_name(pickle.name.replace("_submitted.pkl", "_0_log.out"))
    return task.after_ranks(status, last_error_line(log))


def last_error_line(log: Path, tail_bytes: int = 65536) -> str:
    """The last line of a rank's log that names an error (`SomeError: ...`), '' when there is none."""
    import re

    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln.strip() for ln in lines if re.match(r"^\w*(Error|Exception)\b.*:", ln.strip())]
    return errors[-1][:400] if errors else ""


if __name__ == "__main__":
    main()
