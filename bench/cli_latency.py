"""How long the `taehv` commands that only look or print take to answer, against `python -c pass`.

    python3 bench/cli_latency.py [--runs 9] [--job-dir DIR --job JOB] [--out FILE] [--smoke]

Each command is a fresh process, `python -m taehv_slurm ...` from the repository root, as a user's
`taehv ...` is: `submit --nodes 8 --dry-run` (configs/cluster/h100_8gpu.yaml) with its data check skipped,
and with it (the shipped config's data/prepared, not in a checkout: found missing, exit 2 as expected),
`status`, `status --all`, `logs JOB` and `cancel JOB`. Like any submit, the dry run asks Slurm for its
configuration; where none answers it still runs (its Slurm rows not checked), and the result says which
(`info.slurm`). The baseline, `python -c pass`, runs in the same
rounds, so a loaded machine slows both alike: each round runs every command once, in turn. Reported per
command: the median and fastest wall seconds over the rounds, the median as a ratio to the baseline's, and
whether the command imported pandas or torch (from one more run under `python -X importtime`). By default
the commands keep Python's bytecode in a temporary folder, as any installed package has it (an environment
with PYTHONDONTWRITEBYTECODE=1 would otherwise compile every module from source in every command:
--no-bytecode measures that).

Without --job-dir, a job folder is made first in a temporary directory: a finished smoke job
(`taehv submit --local --task smoke`) and, unless --smoke, a finished 2-step run of configs/train/tiny.yaml,
so that `status`, `logs` and `cancel` read real runs (`cancel` of an ended job answers that there is
nothing to cancel). --smoke: 2 rounds, the smoke job only (the test suite runs it). JSON under
bench/results/ (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import code_version, write_results  # noqa: E402
from taehv_slurm.common.runfolder import EventLog, JobDir  # noqa: E402
from taehv_slurm.slurm import no_slurm_reason  # noqa: E402

ENV = dict(os.environ)  # the commands' environment (main() sets where Python keeps bytecode)
DATA_CHECKED = "taehv submit --nodes 8 --dry-run, data checked (missing)"
EXIT_CODES = {DATA_CHECKED: 2}  # a dry run whose data check fails exits 2; every other command 0


def commands(job_dir: Path, job: str) -> dict[str, list[str]]:
    taehv = [sys.executable, "-m", "taehv_slurm"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "taehv submit --nodes 8 --dry-run": [*taehv, "submit", "--cluster", "configs/cluster/h100_8gpu.yaml",
                                             "--nodes", "8", "--dry-run", "--skip-data-checks"],
        DATA_CHECKED: [*taehv, "submit", "--cluster", "configs/cluster/h100_8gpu.yaml", "--nodes", "8",
                       "--dry-run"],
        "taehv status": [*taehv, "status", "--job-dir", str(job_dir)],
        "taehv status --all": [*taehv, "status", "--all", "--job-dir", str(job_dir)],
        "taehv logs JOB": [*taehv, "logs", job, "--job-dir", str(job_dir)],
        "taehv cancel JOB": [*taehv, "cancel", job, "--job-dir", str(job_dir)],
    }


def make_job_dir(job_dir: Path, smoke: bool) -> str:
    """Finished runs in `job_dir` (see the module docstring); returns the job id of the last one."""
    runs = [["--task", "smoke", "--name", "smoke"]]
    if not smoke:
        runs.append(["--train", "configs/train/tiny.yaml", "--set", "steps=2", "--name", "tiny"])
    for extra in runs:
        done = subprocess.run([sys.executable, "-m", "taehv_slurm", "submit", "--local", *extra,
                               "--set", f"job_dir={job_dir}"], cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        if done.returncode:
            sys.exit(f"making the job folder failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return EventLog(JobDir(job_dir).registry).read()[-1]["job_id"]


def timed(argv: list[str], code: int = 0) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV)
    seconds = time.perf_counter() - start
    if done.returncode != code:
        sys.exit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds


def imported(argv: list[str], names: tuple[str, ...] = ("pandas", "torch")) -> dict[str, bool]:
    """Which of `names` the command imports (top-level packages in `-X importtime`'s report)."""
    done = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=ENV)
    seen = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:")}
    return {name: name in seen for name in names}


def measure(cmds: dict[str, list[str]], rounds: int) -> list[dict[str, Any]]:
    for label, argv in cmds.items():  # once untimed: the page cache and the bytecode are warm for every round
        timed(argv, EXIT_CODES.get(label, 0))
    seconds: dict[str, list[float]] = {label: [] for label in cmds}
    for _ in range(rounds):
        for label, argv in cmds.items():
            seconds[label].append(timed(argv, EXIT_CODES.get(label, 0)))
    baseline = statistics.median(seconds["python -c pass"])
    rows = []
    for label, argv in cmds.items():
        median = statistics.median(seconds[label])
        imports = imported(argv)
        rows.append({"command": label, "argv": argv[1:], "median_s": round(median, 3),
                     "min_s": round(min(seconds[label]), 3), "ratio": round(median / baseline, 2),
                     "imports_pandas": imports["pandas"], "imports_torch": imports["torch"],
                     "seconds": [round(s, 3) for s in seconds[label]]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=9, help="rounds: each command once per round")
    p.add_argument("--job-dir", type=Path, help="a job folder with finished runs (default: make one)")
    p.add_argument("--job", help="the job id or run name `logs` and `cancel` get (with --job-dir)")
    p.add_argument("--no-bytecode", action="store_true",
                   help="as the environment says (PYTHONDONTWRITEBYTECODE): maybe every module compiled "
                        "from source in every command")
    p.add_argument("--smoke", action="store_true", help="2 rounds, a smoke job only")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rounds = 2 if args.smoke else args.runs
    with tempfile.TemporaryDirectory(prefix="cli-latency-") as tmp:
        if not args.no_bytecode:  # as after a pip install: the bytecode written once, then read
            ENV.pop("PYTHONDONTWRITEBYTECODE", None)
            ENV["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        if args.job_dir:
            job_dir, job = args.job_dir.resolve(), args.job
            if not job:
                p.error("--job-dir needs --job")
        else:
            job_dir = Path(tmp) / "runs"
            job = make_job_dir(job_dir, args.smoke)
        cmds = commands(job_dir, job)
        skipped: dict[str, str] = {}
        rows = measure(cmds, rounds)
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": platform.processor() or platform.machine() or "cpu", "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": importlib.metadata.version("torch"),
            **code_version(), "rounds": rounds, "slurm": no_slurm_reason(probe=True) or "reachable",
            "bytecode": "as the environment says" if args.no_bytecode else "cached (PYTHONPYCACHEPREFIX)"}
    width = max(len(r["command"]) for r in rows)
    print(f"{'command':<{width}}  median s  fastest s  × python -c pass  imports pandas / torch")
    for r in rows:
        print(f"{r['command']:<{width}}  {r['median_s']:>8.3f}  {r['min_s']:>9.3f}  {r['ratio']:>16.2f}  "
              f"{'yes' if r['imports_pandas'] else 'no'} / {'yes' if r['imports_torch'] else 'no'}")
    write_results(args.out, "cli_latency_smoke" if args.smoke else "cli_latency",
                  {"info": info, "rows": rows, "skipped": skipped})


if __name__ == "__main__":
    main()
