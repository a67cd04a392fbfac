"""What each task runs on the nodes: `python -m taehv_slurm.entry FOLDER`.

submitit's own entry point loads the pickle it finds in FOLDER without asking who wrote it. This
one first refuses a folder or pickle that another user could have written, sets an owner-only umask
(so every log, metric and checkpoint the job writes is private), then hands over to submitit.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .security import UnsafePathError, check_safe_to_load


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m taehv_slurm.entry SUBMITIT_FOLDER")
    folder = Path(args[0])
    os.umask(0o027 if os.environ.get("TAEHV_SHARED_GROUP") else 0o077)
    os.environ["SUBMITIT_FOLDER"] = str(folder)

    import submitit
    from submitit.core.submission import process_job

    pickle = submitit.JobEnvironment().paths.submitted_pickle
    for _ in range(60):  # the submitting side moves the pickle into place right after sbatch returns
        if pickle.exists():
            break
        time.sleep(1)
    try:
        check_safe_to_load(pickle, folder.parent)
    except UnsafePathError as err:
        print(f"[taehv] {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    process_job(folder)


if __name__ == "__main__":
    main()
