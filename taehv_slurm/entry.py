"""What each task runs on the nodes: `python -m taehv_slurm.entry FOLDER`.

First it holds USR2 and SIGTERM (`startup_signals`): a time-limit warning or preemption that arrives
while the task is still starting is kept for the training loop instead of ending the process.

submitit's own entry point loads the pickle it finds in FOLDER without asking who wrote it. This
one then sets an owner-only umask (so every log, metric, TensorBoard file and checkpoint the job
writes is private; group-readable when the cluster config names a group), then refuses a pickle
that another user could have written or replaced — one line naming the path and the fix, exit 2,
nothing deleted — and only then hands over to submitit.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from . import startup_signals
from .security import UnsafePathError, check_safe_to_load, umask_for

PICKLE_WAIT_S = 60  # the submitting side moves the pickle into place right after sbatch returns
REFUSED_EXIT_CODE = 2


def main(argv: list[str] | None = None) -> None:
    startup_signals.hold()  # first: submitit's import and the pickle's (torch) take seconds
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m taehv_slurm.entry SUBMITIT_FOLDER")
    # Before anything is written (submitit's result pickle, the trainer's files, a requeue's pickle).
    os.umask(umask_for(os.environ.get("TAEHV_SHARED_GROUP") or None))
    folder = Path(args[0])
    os.environ["SUBMITIT_FOLDER"] = str(folder)

    import submitit
    from submitit.core.submission import process_job

    try:
        pickle = submitit.JobEnvironment().paths.submitted_pickle
    except (RuntimeError, KeyError) as err:  # not inside a submitit job: no SUBMITIT_EXECUTOR or launcher variables
        detail = f"{err.args[0]} is not set" if isinstance(err, KeyError) else str(err).strip()
        sys.exit(f"[taehv] cannot run {folder}: not inside a job submitted by taehv_slurm ({detail})")
    for _ in range(PICKLE_WAIT_S):
        if pickle.exists():
            break
        time.sleep(1)
    try:
        # The run folder (folder's parent) down to the pickle must be ours alone; folders above it
        # must not be world-writable without the sticky bit.
        check_safe_to_load(pickle, folder.parent)
    except UnsafePathError as err:
        print(f"[taehv] {err}", file=sys.stderr, flush=True)
        sys.exit(REFUSED_EXIT_CODE)
    process_job(folder)


if __name__ == "__main__":
    main()
