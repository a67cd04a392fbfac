"""Compiling once for every attempt: where torch.compile's caches go (taehv_slurm.trainer.speed)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

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
    ops = b"".join((REPO / "taehv_slurm/trainer" / f).read_bytes() for f in ("layers.py", "rgb_head.py"))
    assert Path(got["chosen"]).name.endswith(f"-ops-{hashlib.sha256(ops).hexdigest()[:12]}")
    # one of the user's own stays, and nothing is created in the job folder
    mine = probe(tmp_path / "other-cache", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "mine"))
    assert mine == {"chosen": None, "env": str(tmp_path / "mine")}
    assert not (tmp_path / "other-cache").exists()
