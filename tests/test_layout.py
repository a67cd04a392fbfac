"""The code is arranged by where it runs, and stays readable: checked on the source, as a reviewer would.

- the driver (taehv_slurm/*.py) never imports the trainer or the CLI;
- the rank-side runtime imports only itself and the small shared modules (never the driver's backends,
  which are handed to it; runtime/legacy.py, the one-release pickle alias, is the named exception);
- the trainer imports the runtime and the shared modules, never the driver or the CLI;
- a CLI command never imports another command; jobs/ only runs them;
- a bench script never imports tests/ (the tests import what both use from bench/);
- no module over 500 lines, no function over 60, and the submit path imports no torch;
- the commands that only look or print (`submit --dry-run`, `status`, `logs`, `cancel`) import neither
  pandas nor torch, so they answer at once (bench/cli_latency.py times them).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taehv_slurm.cli import COMMANDS
from tests.helpers import REPO

PACKAGE = REPO / "taehv_slurm"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.py"))


def our_imports(path: Path) -> set[str]:
    """Every taehv_slurm (or jobs/tests) module `path` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            found.update(n for n in names if n.split(".")[0] in ("taehv_slurm", "jobs", "tests"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names
                         if a.name.split(".")[0] in ("taehv_slurm", "jobs", "tests"))
    return found


def layer_of(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in ("runtime", "trainer", "cli", "configs"):
        return parts[1]
    return "shared" if len(parts) > 1 and parts[1] == "common" else "driver"


def is_module(name: str) -> bool:
    """`from taehv_slurm.runtime import signals` names a module; `from x import SomeClass` does not."""
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    return {n for n in our_imports(path) if is_module(n) and n != "taehv_slurm"}


@pytest.mark.parametrize("path", modules(PACKAGE), ids=lambda p: p.name)
def test_the_driver_never_imports_the_trainer_or_the_cli(path: Path) -> None:
    if path.name == "__main__.py":  # `python -m taehv_slurm` is the CLI's own entry: the CLI and nothing else
        assert imported_modules(path) == {"taehv_slurm.cli"}, f"{path.relative_to(REPO)} imports more"
        return
    bad = {n for n in imported_modules(path) if layer_of(n) in ("trainer", "cli")}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_the_design_map_names_the_shared_modules_these_rules_allow() -> None:
    """docs/design.md's map names the shared layer's modules: those of taehv_slurm/common/."""
    text = (REPO / "docs" / "design.md").read_text()
    (listed,) = re.findall(r"shared: ([\w, ]+) \(importable by all\)", text)
    assert {name.strip() for name in listed.split(",")} == {
        p.stem for p in modules(PACKAGE / "common") if p.name != "__init__.py"}


@pytest.mark.parametrize("path", modules(PACKAGE / "common"), ids=lambda p: p.name)
def test_the_shared_layer_imports_only_itself(path: Path) -> None:
    """Every layer imports it, so it imports no layer: where it runs is wherever it is imported."""
    bad = {n for n in imported_modules(path) if layer_of(n) != "shared"}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", modules(PACKAGE / "runtime"), ids=lambda p: p.name)
def test_the_runtime_imports_itself_and_the_shared_modules_only(path: Path) -> None:
    allowed = {"runtime", "shared"} | ({"driver"} if path.name == "legacy.py" else set())
    bad = {n for n in imported_modules(path) if layer_of(n) not in allowed}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", modules(PACKAGE / "trainer"), ids=lambda p: p.name)
def test_the_trainer_imports_the_runtime_and_shared_modules_only(path: Path) -> None:
    bad = {n for n in imported_modules(path) if layer_of(n) not in ("trainer", "runtime", "shared")}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_a_command_never_imports_another_command() -> None:
    for name in COMMANDS:
        path = PACKAGE / "cli" / f"{name}.py"
        others = {f"taehv_slurm.cli.{other}" for other in COMMANDS if other != name}
        assert not imported_modules(path) & others, f"{path.relative_to(REPO)} imports another command"
    for path in modules(REPO / "jobs"):
        assert imported_modules(path) <= {"taehv_slurm.cli"}, (f"{path.relative_to(REPO)} "
                                                               "does more than run a command")


@pytest.mark.parametrize("path", modules(REPO / "bench"), ids=lambda p: p.name)
def test_no_bench_script_imports_the_tests(path: Path) -> None:
    """A bench script runs as `python bench/x.py`, without the test suite: what the tests and the bench both
    use (bench/faults.py, bench/videos.py) lives in bench/, and the tests import it from there."""
    bad = {n for n in our_imports(path) if n.split(".")[0] == "tests"}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def python_files() -> list[Path]:
    return sorted(p for folder in ("taehv_slurm", "jobs", "tests", "bench")
                  for p in (REPO / folder).rglob("*.py"))


def test_no_module_over_500_lines_and_no_function_over_60() -> None:
    too_long = []
    for path in python_files():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


def test_the_submit_path_imports_no_torch() -> None:
    probe = ("import sys, taehv_slurm.cli.submit, taehv_slurm.cli.status, taehv_slurm.training, "
             "taehv_slurm.backends, taehv_slurm.handle; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.stdout.strip() == "False", done.stdout + done.stderr


def a_finished_local_run(job_dir: Path) -> str:
    """The files a finished 2-step run on the local backend leaves (registry line, events, metrics, the
    controller's outcome, rank 0's log), written directly: no job runs. Returns its job id."""
    from taehv_slurm.common.config import load_cluster
    from taehv_slurm.common.runfolder import JobDir

    job_id, run = "4242-abc123", JobDir(job_dir).run("done")
    folder, now = run.submitit, time.time() - 60
    folder.mkdir(parents=True)
    record = {"event": "submitted", "time": now, "job_id": job_id, "run": "done",
              "folder_rel": "done/submitit", "run_dir": str(run.path), "folder": str(folder),
              "backend": "local", "task": "TrainTask",
              "submitted_at": now, "nodes": 1, "world_size": 1,
              "cluster": load_cluster(REPO / "configs/cluster/local.yaml").masked(),
              "train": {"steps": 2}, "plan": {"total_steps": 2}, "sweep": {}}
    JobDir(job_dir).registry.write_text(json.dumps(record) + "\n")
    events = [{"event": "start", "time": now + 5, "began": now + 1, "step": 0, "job_id": job_id,
               "restart_count": 0},
              {"event": "first_step", "time": now + 7, "step": 1, "seconds": 6.0, "job_id": job_id},
              {"event": "finished", "time": now + 9, "step": 2, "job_id": job_id}]
    run.events().path.write_text("".join(json.dumps(e) + "\n" for e in events))
    metrics = [{"step": s, "time": now + 5 + 2 * s, "loss": 1.0 / s} for s in (1, 2)]
    run.metrics().path.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (folder / f"{job_id}_local.json").write_text(json.dumps({"state": "COMPLETED", "job_id": job_id}))
    (folder / f"{job_id}_0_log.out").write_text("train step 2/2 loss 0.5\n")
    return job_id


def test_the_commands_that_only_look_import_neither_pandas_nor_torch(tmp_path: Path) -> None:
    job_dir = tmp_path / "runs"
    job = a_finished_local_run(job_dir)
    commands = [["submit", "--cluster", "configs/cluster/h100_8gpu.yaml", "--nodes", "8", "--dry-run",
                 "--skip-data-checks"],
                ["status", "--job-dir", str(job_dir)], ["status", "--all", "--job-dir", str(job_dir)],
                ["logs", job, "--job-dir", str(job_dir)], ["cancel", job, "--job-dir", str(job_dir)]]
    # Each command in a fresh process; Slurm's presence is taken as given (the dry run asks sinfo first).
    probe = ("import contextlib, io, json, sys\n"
             "import taehv_slurm.slurm as slurm\n"
             "slurm.no_slurm_reason = lambda probe=False: None\n"
             "from taehv_slurm.cli import main\n"
             "out = io.StringIO()\n"
             "with contextlib.redirect_stdout(out):\n"
             "    code = main(json.loads(sys.argv[1]))\n"
             "print(json.dumps({'code': code, 'out': out.getvalue(),\n"
             "                  'loaded': [m for m in ('pandas', 'torch') if m in sys.modules]}))\n")
    outputs = []
    for argv in commands:
        done = subprocess.run([sys.executable, "-c", probe, json.dumps(argv)], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        result = json.loads(done.stdout.splitlines()[-1])
        assert result["code"] in (0, None), (argv, result)
        assert result["loaded"] == [], f"taehv {argv[0]} imported {' and '.join(result['loaded'])}"
        outputs.append(result["out"])
    dry_run, status, status_all, logs, cancel = outputs
    assert "#SBATCH --nodes=8" in dry_run
    for table in (status, status_all):  # the run's row, its goodput (ETTR) included
        assert job in table and "COMPLETED" in table and "2/2" in table and "ettr" in table
    assert "train step 2/2" in logs and "already ended" in cancel


def test_the_design_map_names_every_module() -> None:
    """docs/design.md's table of where code runs names every module of its folder (in backticks)."""
    design = (REPO / "docs" / "design.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in design.splitlines()
            if line.startswith("| `taehv_slurm/")}
    missing = []
    for folder in ("", "runtime/", "trainer/", "cli/"):
        row = rows.get(f"`taehv_slurm/{folder}`" + (" (driver)" if not folder else ""), "")
        missing += [f"taehv_slurm/{folder}{p.name}" for p in modules(PACKAGE / folder)
                    if p.stem not in ("__init__", "__main__") and f"`{p.stem}`" not in row]
    assert not missing, f"docs/design.md does not place: {missing}"


def test_the_docs_cite_only_tests_that_exist() -> None:
    """Every `tests/test_x.py::test_name` in README.md and docs/*.md names a test function of that file."""
    cited = re.compile(r"tests/(test_\w+)\.py::(\w+)")
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for module, name in cited.findall(doc.read_text()):
            path = REPO / "tests" / f"{module}.py"
            names = ({n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
                     if path.exists() else set())
            if name not in names:
                missing.append(f"{doc.relative_to(REPO)}: tests/{module}.py::{name}")
    assert not missing, "\n".join(missing)


def test_ruff_is_clean_at_the_configured_line_length() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


def test_no_two_modules_share_a_name() -> None:
    """A module's name tells which one it is, whatever its layer, and is not a package's (cli/common.py beside
    common/ read as one thing)."""
    names = [p.stem for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    packages = {p.parent.name for p in PACKAGE.rglob("__init__.py")}
    assert sorted({n for n in names if names.count(n) > 1 or n in packages}) == []


def test_only_the_run_folder_module_spells_the_run_folders_file_names() -> None:
    """The run folder's files are named in taehv_slurm/common/runfolder.py alone, in code, comments and
    docstrings: every other module asks RunFolder or JobDir for their paths and speaks of what they hold."""
    from taehv_slurm.common import runfolder

    names = {runfolder.EVENTS, runfolder.METRICS, runfolder.ATTEMPTS, runfolder.TRACKERS, runfolder.LOCK,
             runfolder.REGISTRY}
    home = PACKAGE / "common/runfolder.py"
    spelled = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in PACKAGE.rglob("*.py") if p != home
               for n, line in enumerate(p.read_text().splitlines(), 1) if any(name in line for name in names)]
    assert not spelled, sorted(spelled)
