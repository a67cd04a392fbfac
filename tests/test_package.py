"""The package as a user installs it: a wheel built from the repository, in a fresh venv, used from an
empty folder (no checkout on the path). The example configs ship inside the package, so the CLIs'
`configs/...` defaults and the README's Python snippet work from anywhere."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel installed; its python. Dependencies come from this interpreter's site-packages
    (the test machine has no index), the project's own modules only from the wheel."""
    root = tmp_path_factory.mktemp("package")
    # Build from a copy of the files git would commit, so the build writes nothing into the checkout.
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    source = root / "source"
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "wheel"), str(source)], check=True, capture_output=True)
    wheel = next((root / "wheel").glob("taehv_slurm-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    return python


def run_in(folder: Path, python: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TAEHV_JOB_DIR")}
    return subprocess.run([str(python), *args], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)


def saved_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*/state.pt"))


def test_modules_load_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    probe = ("import configs, jobs.submit, taehv_slurm, trainer.train; "
             "print('\\n'.join(m.__file__ for m in (configs, jobs.submit, taehv_slurm, trainer.train)))")
    done = run_in(tmp_path, installed, "-c", probe)
    assert done.returncode == 0, done.stderr
    site = str(installed.parent.parent / "lib")
    for path in done.stdout.split():
        assert path.startswith(site) and not path.startswith(str(REPO)), path


def test_dry_run_from_an_empty_folder(installed: Path, tmp_path: Path) -> None:
    done = run_in(tmp_path, installed, "-m", "jobs.submit", "--nodes", "2", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2" in done.stdout and "#SBATCH --ntasks-per-node=8" in done.stdout
    assert "effective batch" in done.stdout  # the plan for the shipped configs/train/taehv.yaml
    assert list(tmp_path.iterdir()) == []  # a dry run creates nothing


def test_local_run_and_the_readme_snippet_from_an_empty_folder(installed: Path, tmp_path: Path) -> None:
    done = run_in(tmp_path, installed, "-m", "jobs.submit", "--local", "--train", "configs/train/tiny.yaml",
                  "--set", "steps=3", "--set", "intervals.val_every=3", "--name", "wheel")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "runs" / "wheel"
    assert saved_steps(run) == [3]
    assert '"step": 3' in (run / "metrics.jsonl").read_text()

    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"From Python or a notebook.*?```python\n(.*?)```", readme, re.S).group(1)
    snippet = snippet.replace("steps=20", "steps=2")  # the same snippet, shorter
    done = run_in(tmp_path, installed, "-c", snippet)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "COMPLETED" in done.stdout
    assert saved_steps(tmp_path / "runs" / "run1") == [2]
