"""Compiling once for every attempt: where torch.compile's caches (taehv_slurm.trainer.speed) and Python's
bytecode (taehv_slurm.runtime.bytecode) go."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import REPO

# In a fresh process, as on a rank: the trainer imports diffusers (the teacher), which makes torch write its
# default cache folder into the environment before anything compiles.
PROBE = """
import json, os, sys
import diffusers  # noqa: F401
from taehv_slurm.trainer.speed import use_compile_cache
chosen = use_compile_cache(sys.argv[1])
print(json.dumps({"chosen": chosen and str(chosen), "env": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


def probe(folder: Path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | env
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True,
                          cwd=REPO, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_compile_cache_is_the_job_folders_unless_the_user_chose_one(tmp_path: Path) -> None:
    import torch

    got = probe(tmp_path / "compile-cache")
    key = f"torch-{torch.__version__}-cuda-{torch.version.cuda or 'none'}".replace("/", "_")
    assert got["env"] == got["chosen"] and Path(got["chosen"]).parent == tmp_path / "compile-cache"
    assert Path(got["chosen"]).name.startswith(key.split("+")[0]) and Path(got["chosen"]).is_dir()
    # the custom ops' code too: their backward formulas are not in torch's cache keys
    ops = b"".join((REPO / "taehv_slurm/trainer" / f).read_bytes() for f in ("layers.py", "rgb_head.py",
                                                                            "first_conv.py"))
    assert Path(got["chosen"]).name.endswith(f"-ops-{hashlib.sha256(ops).hexdigest()[:12]}")
    # one of the user's own stays, and nothing is created in the job folder
    mine = probe(tmp_path / "other-cache", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "mine"))
    assert mine == {"chosen": None, "env": str(tmp_path / "mine")}
    assert not (tmp_path / "other-cache").exists()


def test_the_training_graph_is_one_the_aot_autograd_cache_takes(tmp_path: Path) -> None:
    """A warm start loads the compiled training pass from the AOT autograd cache instead of tracing its
    joint graph again. torch >= 2.12 bypassed that cache for the model's fp32 blocks (autocast switched off
    in the graph; docs/benchmarks.md). A real cold compile of even the tiny model costs ~110 CPU-s, so this
    runs torch's own check, the one that bypassed it, on Dynamo's graphs of the tiny model's training pass."""
    import torch
    import torch._inductor.config as inductor_config
    from torch._functorch._aot_autograd.autograd_cache import check_cacheable

    from taehv_slurm.trainer.losses import DistillModule
    from taehv_slurm.trainer.model import TAEHV, TAEHVConfig
    from taehv_slurm.trainer.speed import use_compile_cache
    from tests.helpers import tiny_train

    module = DistillModule(TAEHV(TAEHVConfig.from_dict(tiny_train().model_fields())))
    graphs = []

    def capture(graph: torch.fx.GraphModule, _inputs: list) -> Callable:
        graphs.append(graph)
        return graph.forward

    frames = torch.randint(0, 256, (1, 8, 3, 32, 32), dtype=torch.uint8)
    latents = torch.randn(1, 2, 16, 4, 4)
    knob = "unsafe_marked_cacheable_functions"  # restored afterwards (torch >= 2.8 has it)
    with pytest.MonkeyPatch.context() as env, inductor_config.patch(
            {knob: {}} if hasattr(inductor_config, knob) else {}):
        env.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        use_compile_cache(tmp_path)
        torch._dynamo.reset()
        try:
            loss, _ = torch.compile(module, backend=capture, dynamic=False)(frames, latents)
            loss.backward()
            assert graphs
            for graph in graphs:
                check_cacheable(graph)  # raises BypassAOTAutogradCache, naming the call it refuses
        finally:
            torch._dynamo.reset()


# A rank: the entry point keeps the bytecode before the job's pickle imports the package; then a child
# process (a data-loader or compile worker) imports more of it.
BYTECODE_PROBE = """
import json, subprocess, sys
from taehv_slurm.runtime.bytecode import keep_bytecode
kept = keep_bytecode(sys.argv[1], "pkg")
import pkg  # noqa: F401
subprocess.run([sys.executable, "-c", "import pkg.child"], check=True)
print(json.dumps(kept and str(kept)))
"""


def test_bytecode_is_kept_in_the_compile_cache_where_the_environment_turns_it_off(tmp_path: Path) -> None:
    """An image that sets PYTHONDONTWRITEBYTECODE with packages installed without bytecode (uv's default)
    made every rank compile torch's source at each start: 6-7 s of a warm start on an H200 machine."""
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("X = 1\n")
    (site / "pkg" / "child.py").write_text("Y = 2\n")
    cache = tmp_path / "compile-cache"
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}

    def rank(**env: str) -> str | None:
        environ = base | {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])} | env
        done = subprocess.run([sys.executable, "-c", BYTECODE_PROBE, str(cache)], capture_output=True,
                              text=True, cwd=tmp_path, env=environ, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert (f"keeping it in {got}" in done.stdout) == (got is not None)  # the rank's log says so
        return got

    kept = cache / "python-bytecode"
    assert rank(PYTHONDONTWRITEBYTECODE="1") == str(kept)
    mirror = kept / str(site / "pkg").lstrip(os.sep)  # Python's pycache prefix mirrors the source's path
    written = {p.name.split(".")[0]: p.stat().st_mtime_ns for p in mirror.glob("*.pyc")}
    assert sorted(written) == ["__init__", "child"]  # the child process's module too
    assert not (site / "pkg" / "__pycache__").exists()  # nothing beside the installed sources
    # the next rank and attempt load it: nothing is compiled or written again
    assert rank(PYTHONDONTWRITEBYTECODE="1") == str(kept)
    assert {p.name.split(".")[0]: p.stat().st_mtime_ns for p in mirror.glob("*.pyc")} == written
    # where Python may write bytecode, it does so as always; a package that has its own keeps using it
    assert rank() is None and (site / "pkg" / "__pycache__").is_dir()
    assert rank(PYTHONDONTWRITEBYTECODE="1") is None
