"""The process that compiles a student's shape aside (`Aside` in taehv_slurm/trainer/precompile.py):
`python -m taehv_slurm.trainer.compile_aside JOB [RANK_PID]`.

Its life is bound to its rank's before it imports torch (seconds, longer on a loaded node): with RANK_PID
(given by a rank that starts it from its main thread), the kernel kills it when the rank ends, SIGKILLed
too (a node's processes killed). Without it, or off Linux, a thread of the compile ends it within a second
of the rank's end, once torch is imported.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def bind_to(rank_pid: int) -> None:
    """Die with the rank: the parent-death signal of prctl(2), then a check that it had not already ended."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl (not Linux): the compile's own watch ends it
        return
    if os.getppid() != rank_pid:  # the rank ended before the line above
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        bind_to(int(sys.argv[2]))
    from taehv_slurm.trainer.precompile import compile_job

    compile_job(sys.argv[1])
