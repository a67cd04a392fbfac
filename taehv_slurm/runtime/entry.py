"""What each task runs on the nodes: `python -m taehv_slurm.runtime.entry FOLDER [RUN_DIR]`.

First it holds USR2 and SIGTERM (`signals`): a time-limit warning or preemption that arrives
while the task is still starting is kept for the training loop instead of ending the process.

submitit's own entry point loads the pickle it finds in FOLDER without asking who wrote it. This
one then sets an owner-only umask (so every log, metric, TensorBoard file and checkpoint the job
writes is private; group-readable when the cluster config names a group), then refuses a pickle
that another user could have written or replaced — one line naming the path and the fix, exit 2,
nothing deleted — and only then hands over to submitit. RUN_DIR is the folder the run owns (`submit()`
passes its run folder); without it, FOLDER itself (an executor folder made with `make_executor`).

A task that raises exits 1 with its traceback printed once (submitit re-raises what it already logged).
A pickle written by the previous release (its modules had other names) still loads (`legacy`).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

from taehv_slurm.runtime import legacy, signals
from taehv_slurm.security import UnsafePathError, check_safe_to_load, umask_for

PICKLE_WAIT_S = 60  # the submitting side moves the pickle into place right after sbatch returns
REFUSED_EXIT_CODE = 2


def main(argv: list[str] | None = None) -> None:
    signals.hold()  # first: submitit's import and the pickle's (torch) take seconds
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        sys.exit("usage: python -m taehv_slurm.runtime.entry SUBMITIT_FOLDER [RUN_DIR]")
    # Before anything is written (submitit's result pickle, the trainer's files, a requeue's pickle).
    os.umask(umask_for(os.environ.get("TAEHV_SHARED_GROUP") or None))
    folder = Path(args[0])
    run_dir = Path(args[1]) if len(args) == 2 else folder
    os.environ["SUBMITIT_FOLDER"] = str(folder)

    import submitit

    from taehv_slurm.runtime.requeue import ReportedError
    from taehv_slurm.submitit_api import process_job

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
        print(f"[taehv] {err}", file=sys.stderr, flush=True)
        sys.exit(REFUSED_EXIT_CODE)
    legacy.install()
    try:
        process_job(folder)
    except ReportedError:  # recorded, and printed on this rank already
        sys.exit(1)
    except Exception:  # submitit logged it and wrote it to the result pickle; print it once, exit 1
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
