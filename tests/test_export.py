"""`python -m jobs.export`: a trained run → the published TAEHV weight file, loaded back with the same
outputs."""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.trainer.model import TAEHV, TAEHVConfig, load_published_weights
from tests.helpers import REPO, cli, final_state
from tests.test_model import published_keys


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained here (`--local`, one rank) for 2 steps, as a user would train it."""
    folder = tmp_path_factory.mktemp("export")
    done = cli("jobs.submit", "--local", "--train", "configs/train/tiny.yaml", "--set", "steps=2",
               "--set", "tasks_per_node=1", "--set", "intervals.val_every=1000", "--name", "run1", cwd=folder)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return folder / "runs" / "run1"


def trained_model(run: Path, dtype: torch.dtype = torch.float32) -> TAEHV:
    """The checkpoint's student, its weights rounded through `dtype` as an export in that dtype stores
    them."""
    _, state, meta = final_state(run)
    model = TAEHV(TAEHVConfig.from_dict(meta["model"]))
    model.load_state_dict({k: v.to(dtype).float() for k, v in state["params"].items()})
    return model.eval()


def outputs(model: TAEHV) -> tuple[torch.Tensor, torch.Tensor]:
    clip = torch.rand(1, 8, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(clip)


# The .pth case passes no --dtype: README promises fp16 by default.
@pytest.mark.parametrize(("name", "flag", "dtype", "torch_dtype"),
                         [("taehv.pth", None, "fp16", torch.float16),
                          ("taehv.safetensors", "fp32", "fp32", torch.float32)])
def test_export_round_trip(run: Path, tmp_path: Path, name: str, flag: str | None, dtype: str,
                           torch_dtype: torch.dtype) -> None:
    done = cli("jobs.export", str(run), "--out", name, *(["--dtype", flag] if flag else []), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "exported step 2" in done.stdout
    # the tiny config's shape is not the published one: the export says which loader reads it
    assert "load it with taehv_slurm.trainer.model.load_published_weights, not the published taehv.py" \
        in done.stdout
    sidecar = json.loads((tmp_path / f"{name}.json").read_text())
    assert sidecar["step"] == 2 and sidecar["dtype"] == dtype and sidecar["config"]["name"] == "tiny"
    assert sidecar["engine"] == "allreduce" and sidecar["world_size"] == 1
    # one file mode for both formats and the sidecar: weights to share
    assert {stat.S_IMODE((tmp_path / f).stat().st_mode) for f in (name, f"{name}.json")} == {0o644}

    reference = trained_model(run, torch_dtype)
    loaded = TAEHV(TAEHVConfig.from_dict(sidecar["model"]))
    load_published_weights(loaded, tmp_path / name)  # the project's loader: both formats, strict keys
    for ours, theirs in zip(outputs(loaded.eval()), outputs(reference)):
        assert torch.equal(ours, theirs)
    # as the published taehv.py reads it: torch.load(weights_only=True), then load_state_dict
    if name.endswith(".pth"):
        stored = torch.load(tmp_path / name, map_location="cpu", weights_only=True)
        assert list(stored) == list(TAEHV(TAEHVConfig.from_dict(sidecar["model"])).state_dict())
        assert {t.dtype for t in stored.values()} == {torch.float16}


def test_readme_round_trip(run: Path, tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    command = re.search(r"`(taehv export runs/run1)` writes", readme).group(1)
    snippet = re.search(r"loads only here, and the export says so:\n\n```python\n(.*?)```", readme,
                        re.S).group(1)
    shutil.copytree(run, tmp_path / "runs" / "run1")
    # `python -m taehv_slurm` is the `taehv` script
    done = cli("taehv_slurm", *command.split()[1:], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    check = snippet + ("\nassert latents.shape == (1, 2, 16, 8, 8) and frames.shape == (1, 5, 3, 64, 64)"
                       "\nprint('OK')")
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr
    # by default the export lands inside the run folder: nothing beside the user's own files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_default_shape_exports_the_published_key_list(tmp_path: Path) -> None:
    from taehv_slurm.trainer.weights import published_state_dict

    params = {k: v for k, v in TAEHV(TAEHVConfig()).state_dict().items()}
    assert list(published_state_dict(params, {}, torch.float16)) == published_keys()


def test_export_by_run_name_is_the_same_file(run: Path, tmp_path: Path) -> None:
    state = RunFolder(run).checkpoints / "step_00000002" / "state.pt"
    by_path = cli("jobs.export", str(state), "--out", "a.pth", cwd=tmp_path)
    by_name = cli("jobs.export", "run1", "--job-dir", str(run.parent), "--out", "b.pth", cwd=tmp_path)
    assert by_path.returncode == 0 and by_name.returncode == 0, by_path.stderr + by_name.stderr
    assert (tmp_path / "a.pth").read_bytes() == (tmp_path / "b.pth").read_bytes()


@pytest.mark.parametrize(("source", "out", "says"), [
    ("nowhere", "x.pth", "no such run or checkpoint"),
    (".", "x.pth", "holds no saved checkpoint yet"),
    ("RUN", "x.onnx", "name the file .pth (torch) or .safetensors"),
    ("RUN", "missing/x.pth", "does not exist; create it"),
])
def test_export_errors_are_one_line(run: Path, tmp_path: Path, source: str, out: str, says: str) -> None:
    done = cli("jobs.export", str(run) if source == "RUN" else source, "--out", out, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written
