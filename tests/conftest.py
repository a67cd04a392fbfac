"""Fixtures shared by the test modules, and the one Slurm testbed of a test run."""

from __future__ import annotations

import fcntl
import gc
import os
import sys
import time
from collections.abc import Iterator

import pytest

from tests.slurm_testbed import REPO, Testbed, TestbedError

# Three xdist workers share CI's two cores: one intra-op thread in each test process and in each process it
# starts (torch otherwise starts one per core, and they only contend here). Set before anything imports torch.
# Measured: the model, engine and bench-smoke tests took 15 % less CPU (docs/contributing.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTBED = Testbed(REPO / ".testbed", nodes=3)  # 3: a job of 2 nodes can be requeued without a failed one
# Under pytest-xdist the workers share one testbed: the first to need it starts it (the others wait on this
# lock, then find it up), and the controller stops it once every worker has finished.
START_LOCK = REPO / ".testbed.lock"
was_up_before_the_run = pytest.StashKey[bool]()


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"


# The modules that take longest (time limits, preemptions, world sizes, hangs: Slurm's clocks and most of
# the CPU) run first, so the xdist workers end together instead of one finishing the longest module alone;
# the rest keep their order. Set by `--durations` of whole runs (docs/contributing.md). The last: 2 minutes
# of following a sweep that waits, no CPU.
LONGEST_FIRST = ("test_requeue.py", "test_any_world_size.py", "test_requeue_outcomes.py", "test_restarts.py",
                 "test_precompile.py", "test_hangs.py", "test_bench_smoke.py", "test_failures.py",
                 "test_stragglers.py", "test_status_scale.py")


# tests/test_gpu.py checks training runs that go on in the background from the first GPU test of a run
# (tests/gpu_runs.py): its tests, which wait for them, run after every other module's.
WAITS_FOR_GPU_RUNS = "test_gpu.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> tuple[int, bool]:
        name = item.path.name
        return (LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST),
                name == WAITS_FOR_GPU_RUNS)

    items.sort(key=rank)  # stable: each module's own order stays


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection imported (torch, pandas, every test module) lives as long as this process: out of the
    # collector's full passes from here on, as a rank's start is (taehv_slurm/runtime/collector.py).
    # 6–7 % less CPU over the in-process tests of four modules.
    gc.freeze()


@pytest.fixture(autouse=True)
def _gpu_runs_beside_the_gpu_tests(request: pytest.FixtureRequest) -> None:
    """The first GPU test of a pytest run that holds tests/test_gpu.py starts the runs it checks."""
    if request.node.get_closest_marker("gpu") is None:
        return
    from tests import gpu_runs

    if gpu_runs.wanted() and any(item.path.name == WAITS_FOR_GPU_RUNS for item in request.session.items):
        gpu_runs.start(request.getfixturevalue("tmp_path_factory"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if "tests.gpu_runs" in sys.modules:  # runs a failed or interrupted pytest run left
        sys.modules["tests.gpu_runs"].stop()


def pytest_configure(config: pytest.Config) -> None:
    if _is_xdist_controller(config):
        config.stash[was_up_before_the_run] = TESTBED.is_up()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not config.stash.get(was_up_before_the_run, True):
        TESTBED.stop()


# ===================================================================== the real Slurm testbed (begin)
@pytest.fixture(scope="session")
def slurm_cluster(pytestconfig: pytest.Config) -> Iterator[Testbed]:
    """A real 3-node Slurm cluster (tb1-tb3; 8 fake GPUs and 16 CPUs each; accounting on) on this machine.

    Started once per test run under <repo>/.testbed and stopped at its end; if the CLI
    (`python -m tests.slurm_testbed start`) already runs that testbed, it is used and left running.
    SLURM_CONF is set in os.environ for the whole session, so tests call sbatch/squeue/sacct and submitit
    directly. Missing Slurm or not root is a failure (never a skip): run scripts/setup.sh.
    """
    bed = TESTBED
    began = time.monotonic()
    try:
        with open(START_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
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
        # a worker leaves it to the controller; one the CLI (or someone else) had started stays up for them
        if not bed.reused and not hasattr(pytestconfig, "workerinput"):
            bed.stop()
# ======================================================================= the real Slurm testbed (end)
