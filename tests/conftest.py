"""Fixtures shared by the test modules."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.slurm_testbed import REPO, Testbed, TestbedError


# ===================================================================== the real Slurm testbed (begin)
@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Testbed]:
    """A real 3-node Slurm cluster (tb1-tb3; 8 fake GPUs and 16 CPUs each; accounting on) on this machine.

    Started once per test session under <repo>/.testbed and stopped at the end; if the CLI
    (`python -m tests.slurm_testbed start`) already runs that testbed, it is used and left running.
    SLURM_CONF is set in os.environ for the whole session, so tests call sbatch/squeue/sacct and submitit
    directly. Missing Slurm or not root is a failure (never a skip): run scripts/setup.sh.
    """
    bed = Testbed(REPO / ".testbed", nodes=3)  # 3: a job of 2 nodes can be requeued without a failed one
    began = time.monotonic()
    try:
        bed.start()
    except TestbedError as err:
        pytest.fail(str(err), pytrace=False)
    how = "kept running" if bed.reused else f"up in {time.monotonic() - began:.1f} s"
    print(f"\n[slurm testbed] {how}: SLURM_CONF={bed.conf}")
    try:
        with pytest.MonkeyPatch.context() as environ:
            for key, value in bed.env.items():
                environ.setenv(key, value)
            yield bed
    finally:
        if not bed.reused:  # one the CLI (or someone else) had started stays up for them
            bed.stop()
# ======================================================================= the real Slurm testbed (end)
