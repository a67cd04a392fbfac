"""Process helpers of the Slurm testbed: reading /proc, waiting for a condition, ending processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path


# Defined here, below tests.slurm_testbed and the modules it imports, so that all raise the very same class,
# also when tests.slurm_testbed runs as `python -m` (as __main__, a module of its own whose classes are new).
class TestbedError(RuntimeError):
    """The testbed could not start; the first line of the message says why."""

    __test__ = False  # not a pytest test class, despite its name


# Popen objects of the daemons this Python process started, by pid: kept so they can be reaped
# (waited for) when stopped, instead of lingering as zombies of the test process.
CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def read(path: str) -> str:
    try:
        return Path(path).read_bytes().decode(errors="replace")
    except OSError:
        return ""


def uts(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    child = CHILDREN.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        del CHILDREN[pid]  # reaped
        return False
    stat = read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")  # a zombie is dead


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def terminate(pids: list[int], sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10) -> None:
    """Send `sig` to each pid, wait for all to end, SIGKILL the ones that would not."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if not wait_until(lambda: not any(map(alive, pids)), timeout_s):
        for pid in filter(alive, pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(map(alive, pids)), 5)


def other_slurm_daemons() -> list[int]:
    """Slurm daemons still running on this machine (called once ours are stopped: so, someone else's)."""
    names = {"slurmctld", "slurmd", "slurmdbd", "slurmstepd"}
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and read(f"{p}/comm").strip() in names and alive(int(p.name))]


# ------------------------------------------------------------- Slurm's and MariaDB's commands
def which(tool: str, env: Mapping[str, str]) -> str | None:
    return shutil.which(tool, path=environ_with(env)["PATH"])


def environ_with(extra: Mapping[str, str]) -> dict[str, str]:
    """Our environment plus `extra`, with /usr/sbin on PATH: Debian puts the daemons there, and not every
    PATH has it (a non-login shell, CI)."""
    path = extra.get("PATH") or os.environ.get("PATH", "/usr/bin:/bin")
    missing = [d for d in ("/usr/sbin", "/sbin") if d not in path.split(":")]
    return {**os.environ, **extra, "PATH": ":".join([path, *missing])}


def client_output(argv: list[str], env: Mapping[str, str], check: bool = False,
                  timeout_s: float = 20) -> str | None:
    """stdout of a short client command, or None if it failed (raises instead when check)."""
    try:
        done = subprocess.run(argv, env=environ_with(env), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if check:
            raise TestbedError(f"Slurm testbed: `{' '.join(argv)}` hung for {timeout_s:.0f} s") from None
        return None
    if done.returncode != 0:
        if check:
            raise TestbedError(f"Slurm testbed: `{' '.join(argv)}` failed: "
                               f"{(done.stderr or done.stdout).strip()}")
        return None
    return done.stdout


def succeeds(argv: list[str], env: Mapping[str, str]) -> bool:
    return subprocess.run(argv, env=environ_with(env), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def munge_works(env: Mapping[str, str]) -> bool:
    return succeeds(["munge", "-n"], env)


def log_tail(*logs: Path, lines: int = 15) -> str:
    """The last lines of the first of `logs` that has any (a daemon's log file, else its stdout)."""
    for log in logs:
        text = read(str(log)).rstrip()
        if text:
            return f"last lines of {log}:\n" + "\n".join(text.splitlines()[-lines:])
    return f"nothing logged in {', '.join(map(str, logs))}"
