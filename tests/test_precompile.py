"""The compiled student saved whole and loaded by later starts (taehv_slurm/trainer/precompile.py): a later
process runs it without tracing and trains exactly as the first did; a changed module or a damaged file is
compiled again, never run stale.

Each start is its own process on one compile cache, as ranks and requeues are: the all-reduce engine with
torch.compile on the CPU (Inductor's C++), a small student (two convolutions: the C++ compiles in seconds),
one step of two micro-batches of different sizes (the last one smaller: two shapes, two files).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

START = r"""
import json, sys
import torch
from torch import nn
from torch._dynamo.utils import counters
from taehv_slurm.trainer.engine import Microbatch, make_engine
from taehv_slurm.trainer.losses import DistillModule


class Student(nn.Module):  # frames N×4×3×H×W → one latent frame → the first frame again
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 16, 4, stride=4)
        self.dec = nn.ConvTranspose2d(16, 3, 4, stride=4)

    def encode_video(self, x):
        n, t = x.shape[:2]
        return self.enc(x.flatten(0, 1)).unflatten(0, (n, t)).mean(1, keepdim=True)

    def decode_video(self, z, clamp=True):
        return self.dec(z.flatten(0, 1)).unflatten(0, z.shape[:2])


torch.manual_seed(0)
module = DistillModule(Student(), reconstruction_weight=float(sys.argv[1]))
engine = make_engine("allreduce", module, torch.device("cpu"), precision="fp32", grad_clip=1.0, lr=1e-3,
                     betas=(0.9, 0.95), weight_decay=0.01, compile=True, compile_mode="default",
                     per_gpu_batch=2, grad_accum=2)
g = torch.Generator().manual_seed(1)
frames = torch.randint(0, 256, (3, 4, 3, 16, 16), dtype=torch.uint8, generator=g)
step = engine.train_step([Microbatch(frames[:2], None, 2 / 3), Microbatch(frames[2:], None, 1 / 3)], 1e-3)
print(json.dumps({"loss": step.means()["loss"], "grad": engine.flat_grad[:-1].tolist(),
                  "outcomes": engine.compiled_outcomes(),
                  "traced": counters["stats"]["unique_graphs"]}))
"""


def start(cache: Path, weight: float = 20.0, **env: str) -> tuple[dict, str]:
    run = subprocess.run([sys.executable, "-c", START, str(weight)], capture_output=True, text=True, cwd=REPO,
                         timeout=300, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
                                           "PYTHONPATH": str(REPO), **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_a_later_start_loads_the_compiled_student_and_a_changed_one_is_compiled_again(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, _ = start(cache)
    assert first["outcomes"] == ["saved", "saved"] and first["traced"] == 2  # one per micro-batch shape
    files = sorted((cache / "precompiled").glob("*.bin"))
    assert len(files) == 2

    again, _ = start(cache)
    assert again["outcomes"] == ["loaded", "loaded"]
    assert again["traced"] == 0  # nothing traced: the point of it
    assert again["loss"] == first["loss"] and again["grad"] == first["grad"]

    # torch.compile's own path (the fast path off) gives the same step: the saved one is the same program
    plain, _ = start(cache, TAEHV_FAST_PATHS_OFF="precompile")
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
