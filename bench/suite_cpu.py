"""Where a command's CPU goes, process by process: the suite's CPU by test module, test and kind of process.

    python3 bench/suite_cpu.py --out bench/results/suite_cpu_by_test_cpu_DATE_COMMIT.json \
        -- python3 -m pytest -q

Runs the command and reads /proc every 0.3 s: each process's CPU seconds (user + system, its last reading
before it ended: a process shorter than one poll is missed, a long one loses under 0.3 s), the test it ran
under (PYTEST_CURRENT_TEST of its environment: pytest sets it for each test, and the test's subprocesses,
their Slurm jobs through sbatch's exported environment and those jobs' ranks inherit it) and its command
line. The suite is CPU-bound on CI's 2 cores (docs/contributing.md), so CPU seconds are what a change must
save. Linux only; the polling cost 1.1 % of one core through a run of the suite
(bench/results/suite_cpu_by_test_cpu_2026-12-06_20aa0c1-dirty.json).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench._record import run_info  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
DAEMONS = ("slurmctld", "slurmd", "slurmdbd", "slurmstepd", "mariadbd", "munged")
OUTSIDE = "(outside any test: pytest and its workers, the testbed's daemons)"


def kind(cmdline: str) -> str:
    """What a process runs: its module (python -m X) or script (by its path in the repo, else its name),
    else its program. A rank's forked child (a loader worker) keeps the rank's command line, so it is one
    more process of the rank's kind."""
    words = cmdline.split()
    if not words:
        return "?"
    if "-m" in words[:3] and words.index("-m") + 1 < len(words):
        return f"python -m {words[words.index('-m') + 1]}"
    if "-c" in words[:3]:
        return "python -c (a test's own process, or a pytest-xdist worker)"
    program = Path(words[0]).name
    if re.fullmatch(r"python[\d.]*", program) and len(words) > 1:
        script = Path(words[1])  # no machine's own path: an absolute one outside the repo by its name
        if script.is_absolute():
            script = script.relative_to(REPO) if script.is_relative_to(REPO) else Path(script.name)
        return f"python {script}"
    return program if program in DAEMONS else program[:40]


def read_process(pid: str) -> tuple[str, float, str, str] | None:
    """(start time, CPU seconds, test, command line) of process `pid`, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        cpu = (int(stat[11]) + int(stat[12])) / TICK
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, IndexError):
        return None
    test = next((e.split(b"=", 1)[1].decode(errors="replace") for e in env
                 if e.startswith(b"PYTEST_CURRENT_TEST=")), "")
    return stat[19].decode(), cpu, test.rsplit(" (", 1)[0], cmdline.strip()


def processes() -> Iterator[tuple[str, tuple[str, float, str, str]]]:
    """(pid:start, `read_process`'s reading) of every process now; pids are reused, so the start too."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if found := read_process(pid):
            yield f"{pid}:{found[0]}", found


def poll(seen: dict[str, list[Any]], before: set[str], done: threading.Event, every_s: float = 0.3) -> None:
    """Until `done`: the latest CPU seconds of every process not in `before`."""
    while not done.is_set():
        for key, (_, cpu, test, cmdline) in processes():
            if key not in before:
                seen.setdefault(key, [test, cmdline, 0.0])[2] = cpu
        done.wait(every_s)


def summary(seen: dict[str, list[Any]], top: int) -> dict[str, Any]:
    """CPU seconds by test module, test (the `top` costliest) and kind of process; the ranks' own figures."""
    by_module, by_test, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    count: collections.Counter = collections.Counter()
    ranks = []
    for test, cmdline, cpu in seen.values():
        by_test[test or OUTSIDE] += cpu
        by_module[test.split("::")[0] or OUTSIDE] += cpu
        what = kind(cmdline)
        by_kind[what] += cpu
        count[what] += 1
        if what == "python -m taehv_slurm.runtime.entry":
            ranks.append(cpu)
    ranks.sort()
    started = [cpu for cpu in ranks if cpu > 2]  # a rank, not a forked loader worker of one
    return {"cpu_s": round(sum(cpu for *_, cpu in seen.values()), 1), "processes": len(seen),
            "by_module": {k: round(v, 1) for k, v in by_module.most_common()},
            "by_test": {k: round(v, 1) for k, v in by_test.most_common(top)},
            "by_kind": {k: {"cpu_s": round(v, 1), "processes": count[k]}
                        for k, v in by_kind.most_common()},
            "ranks": {"processes": len(ranks), "cpu_s": round(sum(ranks), 1), "over_2_cpu_s": len(started),
                      "median_cpu_s_over_2": round(started[len(started) // 2], 2) if started else None}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the summary here as JSON")
    p.add_argument("--top", type=int, default=40, help="tests listed, the costliest first")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command: bench/suite_cpu.py [--out FILE] -- COMMAND ARGS...")
    seen: dict[str, list[Any]] = {}
    done = threading.Event()
    before = {key for key, _ in processes()}  # new processes only
    poller = threading.Thread(target=poll, args=(seen, before, done), daemon=True)
    poller.start()
    began = time.monotonic()
    status = subprocess.run(command).returncode
    wall = time.monotonic() - began
    done.set()
    poller.join()
    result = {"info": {**run_info(False), "command": " ".join(command), "exit": status,
                       "wall_s": round(wall, 1)}, **summary(seen, args.top)}
    print(f"{result['cpu_s']:.0f} CPU-s in {wall:.0f} s wall over {result['processes']} processes; by kind:")
    for name, row in list(result["by_kind"].items())[:12]:
        print(f"{row['cpu_s']:9.1f} {row['processes']:6d}  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    sys.exit(status)


if __name__ == "__main__":
    main()
