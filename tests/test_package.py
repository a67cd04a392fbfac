"""The package as a user installs it: a wheel built from the repository, in a fresh venv, used from an
empty folder (no checkout on the path) and from a folder of the user's own whose `trainer.py` and
`configs/` would shadow generic top-level names. The example configs ship inside the package, so the
CLIs' `configs/...` defaults and the README's Python snippet work from anywhere."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from taehv_slurm.common.runfolder import RunFolder
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
    (root / "wheel.txt").write_text("\n".join(zipfile.ZipFile(wheel).namelist()))
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    return python


def run_in(folder: Path, python: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TAEHV_JOB_DIR")}
    return subprocess.run([str(python), *args], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


def saved_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step_"))
                  for p in RunFolder(run).checkpoints.glob("step_*/state.pt"))


@pytest.fixture
def users_folder(tmp_path: Path) -> Path:
    """A user's project folder: their own trainer.py and configs/ package, which must never be imported."""
    (tmp_path / "trainer.py").write_text("raise RuntimeError('the user trainer.py was imported')\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "__init__.py").write_text("raise RuntimeError('the user configs package was "
                                                      "imported')\n")
    (tmp_path / "configs" / "model.yaml").write_text("width: 1\n")
    return tmp_path


def test_the_wheel_installs_one_namespace_and_the_taehv_command(installed: Path, tmp_path: Path) -> None:
    names = (installed.parents[2] / "wheel.txt").read_text().split()
    top = {name.split("/")[0] for name in names}
    assert top == {"taehv_slurm", next(t for t in top if t.endswith(".dist-info"))}, top
    assert ("taehv_slurm/configs/train/tiny.yaml" in names
            and "taehv_slurm/configs/cluster/local.yaml" in names)
    # every module of the source (a package missing from setup.cfg would still import here, from the
    # checkout's editable install beside the venv, and fail on a user's machine)
    sources = subprocess.run(["git", "ls-files", "taehv_slurm/*.py"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert not set(sources) - set(names), sorted(set(sources) - set(names))
    done = run_in(tmp_path, installed.parent / "taehv", "--help")
    assert done.returncode == 0, done.stderr
    for command in ("submit", "status", "logs", "cancel", "export", "prepare", "preflight", "launch"):
        assert re.search(rf"^  {command} ", done.stdout, re.M), done.stdout
    probe = "import taehv_slurm.cli.submit, taehv_slurm.trainer.train as t; print(t.__file__)"
    done = run_in(tmp_path, installed, "-c", probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(installed.parents[1] / "lib")), done.stdout


@pytest.mark.usefixtures("slurm_cluster")  # a dry run asks Slurm about the partition
def test_dry_run_from_an_empty_folder(installed: Path, tmp_path: Path) -> None:
    done = run_in(tmp_path, installed.parent / "taehv", "submit", "--nodes", "2", "--dry-run")
    assert "#SBATCH --nodes=2" in done.stdout and "#SBATCH --ntasks-per-node=8" in done.stdout
    assert "effective batch" in done.stdout  # the plan for the shipped configs/train/taehv.yaml
    # the shipped config trains on data/prepared, which this folder lacks: the dry run says a submit
    # would be refused, and why, with exit 2
    assert done.returncode == 2, done.stderr
    assert "prepared data folder data/prepared does not exist" in done.stdout
    refused = "a submit would be refused: check data failed (nothing was submitted)"
    assert done.stdout.rstrip().endswith(refused)
    assert list(tmp_path.iterdir()) == []  # a dry run creates nothing


def test_taehv_trains_beside_a_users_own_trainer_and_configs(installed: Path, users_folder: Path) -> None:
    done = run_in(users_folder, installed.parent / "taehv", "submit", "--local",
                  "--train", "configs/train/tiny.yaml",
                  "--set", "steps=3", "--set", "intervals.val_every=3", "--name", "wheel")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = users_folder / "runs" / "wheel"
    assert saved_steps(run) == [3]
    assert '"step": 3' in RunFolder(run).metrics().path.read_text()
    assert "export:      taehv export" in done.stdout  # commands named the way the user ran this one


def test_checkout_module_trains_beside_a_users_own_trainer_and_configs(users_folder: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TAEHV_JOB_DIR"} | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "jobs.submit", "--local",
                           "--train", "configs/train/tiny.yaml",
                           "--set", "steps=2", "--set", "intervals.val_every=2", "--name", "checkout"],
                          cwd=users_folder, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert saved_steps(users_folder / "runs" / "checkout") == [2]
    assert "export:      python -m jobs.export" in done.stdout


def test_the_readme_snippet_from_an_empty_folder(installed: Path, tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"From Python or a notebook.*?```python\n(.*?)```", readme, re.S).group(1)
    snippet = snippet.replace("steps=20", "steps=2")  # the same snippet, shorter
    done = run_in(tmp_path, installed, "-c", snippet)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "COMPLETED" in done.stdout
    assert saved_steps(tmp_path / "runs" / "run1") == [2]
