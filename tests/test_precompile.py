"""The compiled student saved whole and loaded by later starts (taehv_slurm/trainer/precompile.py): a later
process runs it without tracing and trains exactly as the first did; a changed module or a damaged file is
compiled again, never run stale. A cold start trains eager while another process compiles the student, then
runs what that process saved: the same program as one compiled in the rank. Signals reach that process as
Slurm sends them: the requeue signals leave it compiling, a SIGTERM ends it, and so does its rank's end.

Each start is its own process on one compile cache, as ranks and requeues are: the all-reduce engine with
torch.compile on the CPU (Inductor's C++), a small student (tests/tiny_student.py: its C++ compiles in
seconds), one step of two micro-batches of different sizes (the last one smaller: two shapes, two files).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO

START = r"""
import json, sys, time
import torch
from torch._dynamo.utils import counters
from taehv_slurm.trainer.engine import Microbatch, make_engine
from taehv_slurm.trainer.losses import DistillModule
from tests.tiny_student import TinyStudent

torch.set_num_threads(2)  # as a rank sets it (runtime.torch_threads), not as OMP_NUM_THREADS=1 of the tests
torch.manual_seed(0)
module = DistillModule(TinyStudent(), reconstruction_weight=float(sys.argv[1]))
engine = make_engine("allreduce", module, torch.device("cpu"), precision="fp32", grad_clip=1.0, lr=1e-3,
                     betas=(0.9, 0.95), weight_decay=0.01, compile=True, compile_mode="default",
                     per_gpu_batch=2, grad_accum=2)
g = torch.Generator().manual_seed(1)
frames = torch.randint(0, 256, (3, 4, 3, 16, 16), dtype=torch.uint8, generator=g)
micro = [Microbatch(frames[:2], None, 2 / 3), Microbatch(frames[2:], None, 1 / 3)]
step = engine.train_step(micro, 1e-3)
result = {"loss": step.means()["loss"], "grad": engine.flat_grad[:-1].tolist(),
          "outcomes": engine.compiled_outcomes()}
steps, began = [result["outcomes"]], time.monotonic()  # then, with argv[2], on until nothing runs eager
eager = {"eager, compiling aside", "eager"}
while len(sys.argv) > 2 and eager & set(steps[-1]) and time.monotonic() - began < 240:
    time.sleep(0.2)
    engine.train_step(micro, 1e-3)
    steps.append(engine.compiled_outcomes())
print(json.dumps({**result, "traced": counters["stats"]["unique_graphs"], "steps": steps}))
"""


def start_env(cache: Path, **env: str) -> dict[str, str]:
    """A start's environment on `cache`: the compile aside off unless TAEHV_FAST_PATHS_OFF says otherwise."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO),
            "TAEHV_FAST_PATHS_OFF": "compile_aside", **env}


def start(cache: Path, weight: float = 20.0, until_compiled: bool = False, script: str = START,
          **env: str) -> tuple[dict, str]:
    """One start on `cache` (its environment: `start_env`), to its end."""
    run = subprocess.run([sys.executable, "-c", script, str(weight), *(["on"] if until_compiled else [])],
                         capture_output=True, text=True, cwd=REPO, timeout=300, env=start_env(cache, **env))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_a_cold_start_trains_eager_while_another_process_compiles_the_student_and_later_starts_load_it(
        tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    aside, _ = start(cache, until_compiled=True, TAEHV_FAST_PATHS_OFF="")
    steps = aside["steps"]
    assert steps[0] == ["eager, compiling aside"] * 2  # the first step did not wait for the compile
    assert steps[-1] == ["compiled aside"] * 2, steps[-1]  # then each shape ran what the other process saved
    assert aside["traced"] == 0  # nothing compiled in the training process
    files = sorted((cache / "precompiled").glob("*.bin"))
    assert len(files) == 2  # one per micro-batch shape
    assert [p.name for p in (cache / "precompiled").iterdir() if p.suffix != ".bin"] == []  # no job, no log

    # A later start loads the files and traces nothing: the point of it.
    first, _ = start(cache)
    assert first["outcomes"] == ["loaded", "loaded"] and first["traced"] == 0
    # What the other process saved is the program this one would have compiled: the step of a rank that
    # compiled the student itself (on its own cache), bit for bit.
    here, _ = start(tmp_path / "here")
    assert here["outcomes"] == ["saved", "saved"] and here["traced"] == 2
    assert first["loss"] == here["loss"] and first["grad"] == here["grad"]
    # the eager step is the same step, to the roundings of another order
    assert abs(aside["loss"] - first["loss"]) <= 1e-6 * abs(first["loss"])

    # torch.compile's own path (the fast path off) gives the same step: the saved one is the same program
    plain, _ = start(cache, TAEHV_FAST_PATHS_OFF="precompile,compile_aside")
    assert plain["outcomes"] == [] and plain["traced"] == 2
    assert abs(plain["loss"] - first["loss"]) <= 1e-6 * abs(first["loss"])

    files[0].write_bytes(files[0].read_bytes()[:100])  # a damaged file: compiled again, as the first did
    repaired, log = start(cache)
    assert repaired["outcomes"] == ["loaded", "saved"]
    assert "did not load" in log and "compiling it again" in log
    assert repaired["loss"] == first["loss"] and repaired["grad"] == first["grad"]

    # Each file holding the other shape's function: its saved guards on the inputs fail at the first run,
    # which compiles it again (and replaces the file), not a step run with the wrong program.
    a, b = sorted((cache / "precompiled").glob("*.bin"))
    content_a = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(content_a)
    swapped, log = start(cache)
    assert swapped["outcomes"] == ["saved", "saved"] and log.count("failed its first run") == 2
    assert swapped["loss"] == first["loss"] and swapped["grad"] == first["grad"]
    assert start(cache)[0]["outcomes"] == ["loaded", "loaded"]

    # Another loss weight is a constant inside the graph, and the file leaves out the guards on the module:
    # the weight is part of the file's name, so the old files are not run with it.
    reweighted, _ = start(cache, weight=10.0)
    assert reweighted["outcomes"] == ["saved", "saved"]
    assert len(list((cache / "precompiled").glob("*.bin"))) == 4
    assert reweighted["loss"] != first["loss"]


def test_a_compile_aside_that_fails_leaves_its_log_and_the_rank_compiles_it(tmp_path: Path) -> None:
    # A student class defined in the script that trains (in __main__): the compiling process cannot unpickle
    # it, fails, and the rank names its log and compiles the student itself.
    script = START.replace("module = DistillModule(TinyStudent()",
                           "class OwnStudent(TinyStudent):\n    pass\n\nmodule = DistillModule(OwnStudent()")
    failed, log = start(tmp_path / "c", until_compiled=True, script=script, TAEHV_FAST_PATHS_OFF="")
    assert failed["steps"][0] == ["eager, compiling aside"] * 2
    assert failed["steps"][-1] == ["saved", "saved"]
    assert log.count("was not compiled aside") == 2
    logs = sorted((tmp_path / "c" / "precompiled").glob("*.log"))
    assert len(logs) == 2 and all("OwnStudent" in p.read_text() for p in logs)  # its error, kept


def compiling_aside(cache: Path) -> list[int]:
    """The processes compiling the student for a start on `cache` (their job files are in it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or one that ended
            continue
        if b"taehv_slurm.trainer.compile_aside" in cmdline and any(str(cache).encode() in a for a in cmdline):
            found.append(int(proc.name))
    return found


def start_compiling_aside(cache: Path) -> tuple[subprocess.Popen, list[int]]:
    """A start on `cache` that compiles aside, once both its compiling processes run; one whose compile
    aside a SIGTERM ended starts another after 1 s (not a minute)."""
    script = "from taehv_slurm.trainer.precompile import Aside\nAside.RETRY_S = 1.0\n" + START
    run = subprocess.Popen([sys.executable, "-c", script, "20.0", "on"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env=start_env(cache, TAEHV_FAST_PATHS_OFF=""))
    deadline = time.monotonic() + 60
    while len(pids := compiling_aside(cache)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    if len(pids) < 2:
        run.kill()
        raise AssertionError("no process compiled the student aside")
    return run, pids


def test_a_signal_to_the_compile_aside_is_the_ranks_to_act_on(tmp_path: Path) -> None:
    # Slurm signals every process of a job step. The requeue signals are the rank's: the compile goes on.
    # A SIGTERM (preemption, the time limit) ends it, and the rank trains on eager rather than compiling
    # in the time it has left to save; if the rank goes on (the SIGTERM was not for it), it compiles aside
    # again later. A rank that ends at once (SIGKILL: a node's processes killed) takes its compiles along.
    cache = tmp_path / "cache"
    run, pids = start_compiling_aside(cache)
    try:
        for pid in pids:  # at once: blocked from their first instruction
            os.kill(pid, signal.SIGUSR1)
            os.kill(pid, signal.SIGUSR2)
        time.sleep(1.0)
        assert sorted(compiling_aside(cache)) == sorted(pids)  # still compiling
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while len(again := set(compiling_aside(cache)) - set(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(again) == 2  # compiling aside again, a retry's wait (1 s here) after
    finally:
        run.kill()
    # at once, not once torch is imported in them (seconds, more on a loaded node: a whole test run)
    deadline = time.monotonic() + 1
    while compiling_aside(cache) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert compiling_aside(cache) == []
    _, err = run.communicate(timeout=30)
    assert err.count("the compile aside was stopped (signal 15)") == 2
    assert "compiling it in this process" not in err and "Traceback" not in err


KEY = r"""
import torch
from taehv_slurm.trainer.losses import DistillModule
from taehv_slurm.trainer.precompile import PrecompiledForward
from tests.tiny_student import TinyStudent

torch.manual_seed(0)
forward = PrecompiledForward(DistillModule(TinyStudent()), "default", None, None)
print(forward.key((torch.zeros(2, 4, 3, 16, 16, dtype=torch.uint8), None, 1.0)))
"""


def test_a_file_is_found_by_every_rank_and_not_run_under_other_compiler_settings(tmp_path: Path) -> None:
    """The file's name holds Inductor's settings: a start with another (a user's TORCHINDUCTOR_* variable)
    compiles its own instead of running one compiled otherwise; a rank of another allocation (its compile
    cache elsewhere, fewer CPUs) names the same file."""
    def key(*prefix: str, **env: str) -> str:
        run = subprocess.run([*prefix, sys.executable, "-c", KEY], capture_output=True, text=True, cwd=REPO,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stdout.strip()

    here = str(tmp_path / "a")
    plain = key(TORCHINDUCTOR_CACHE_DIR=here)
    assert key("taskset", "-c", "0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "b")) == plain
    assert key(TORCHINDUCTOR_CACHE_DIR=here, TORCHINDUCTOR_COORDINATE_DESCENT_TUNING="1") != plain
