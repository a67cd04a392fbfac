"""How fast the job runs against what the hardware allows, and compiling once for every attempt.

- `model_flops_per_clip`: the student's training FLOPs per clip, counted by torch's FlopCounterMode on one
  clip's forward (no grad, fake tensors) times 3 (backward ≈ 2× forward: the input and weight gradients),
  the usual convention for model FLOPs utilisation (MFU); counted once, then read from the compile cache.
- `mfu`: clips/s per GPU × FLOPs per clip / the GPU's dense bf16 peak (vendor datasheets), logged with
  every metrics line on GPUs of a known peak.
- `use_compile_cache`: inductor's caches (FX graphs, AOT autograd, Triton kernels) in a folder on the
  shared filesystem, one per torch and CUDA version, so requeues, resubmits, shards and ranks load what
  one of them compiled instead of compiling again (~40 s per start on an H100). The cache keys each
  graph by its code, shapes and the compiler's settings, and the folder's name by our custom ops' code:
  a changed model never reuses a stale entry. It also lets the AOT autograd cache take the model's graphs
  (`AUTOCAST_IN_GRAPH`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import re
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from taehv_slurm.common.runfolder import write_text_atomic

# Dense bf16 tensor-core peak per GPU, TFLOP/s (NVIDIA datasheets; sparse figures are twice these).
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "H200": 989.4, "GH200": 989.4,
                    "A100": 312.0, "L40S": 362.1, "B200": 2250.0}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s (None on CPUs, in fp32, or for a GPU not in the table)."""
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def model_flops_per_clip(module: torch.nn.Module, frames: int, height: int, width: int,
                         device: torch.device, latent_channels: int,
                         cache_dir: str | os.PathLike | None = None) -> float:
    """Training FLOPs of one clip: 3 × the forward's, counted on one clip (eval mode, no grad) of fake
    tensors: shapes only, no device time or memory (a real full-size forward, which this falls back to
    should a layer not run on fake tensors, took both before the first step of every attempt).

    With `cache_dir` (the compile cache folder), an attempt reuses what an earlier one counted for the same
    model code, settings, clip shape and torch (its model-flops.json): the count cost each warm start on an
    H200 ~2 s."""
    key = _flops_key(module, (frames, height, width, latent_channels))
    cache = Path(cache_dir) / "model-flops.json" if cache_dir else None
    known = _read_counts(cache).get(key) if cache else None
    if isinstance(known, float):
        return known
    flops = _count_flops(module, frames, height, width, device, latent_channels)
    if cache:
        with contextlib.suppress(OSError):  # a read-only share: count again next time
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(cache, json.dumps({**_read_counts(cache), key: flops}, indent=1))
    return flops


def _flops_key(module: torch.nn.Module, shape: tuple[int, ...]) -> str:
    """The module's code (the source files of its classes), structure and plain settings, the clip shape
    and torch's version: what the count depends on."""
    parts = [torch.__version__, repr(shape), repr(module)]
    for file in sorted({inspect.getsourcefile(type(m)) or "" for m in module.modules()}):
        with contextlib.suppress(OSError):  # no source installed: structure and settings still count
            parts.append(Path(file).read_text())
    for m in module.modules():
        parts.append(repr(sorted((k, v) for k, v in vars(m).items()
                                 if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple)))))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _read_counts(cache: Path) -> dict[str, float]:
    try:
        counts = json.loads(cache.read_text())
    except (OSError, ValueError):  # none yet, or damaged: count again and write a good one
        return {}
    return {k: v for k, v in counts.items() if isinstance(v, float)} if isinstance(counts, dict) else {}


@torch.no_grad()
def _count_flops(module: torch.nn.Module, frames: int, height: int, width: int, device: torch.device,
                 latent_channels: int) -> float:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def count(fake: bool) -> float:
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            clip = torch.zeros(1, frames, 3, height, width, dtype=torch.uint8, device=device)
            latents = torch.zeros(1, frames // 4, latent_channels, height // 8, width // 8, device=device)
            with FlopCounterMode(display=False) as counter:
                module(clip, latents)
        return 3.0 * counter.get_total_flops()

    was_training = module.training
    module.eval()
    try:
        return count(fake=True)
    except Exception:  # noqa: BLE001 - an op without a fake-tensor rule: count it the slow way
        return count(fake=False)
    finally:
        module.train(was_training)


def mfu(clips_per_s_per_gpu: float, flops_per_clip: float, peak: float | None) -> float | None:
    return round(clips_per_s_per_gpu * flops_per_clip / peak, 4) if peak else None


# Dynamo records the model's `torch.autocast(enabled=False)` blocks (its weights composed in fp32, layers.py)
# as calls of these two functions. torch >= 2.12 no longer counts them safe for its AOT autograd cache, which
# then bypassed the whole training graph: every start traced the joint graph again (docs/benchmarks.md: the
# compiled student's warm start on CPU). What they do is fixed by their constant arguments, which are part of
# the graph and so of the cache key.
AUTOCAST_IN_GRAPH = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")


def use_compile_cache(folder: str | os.PathLike | None) -> Path | None:
    """Point inductor's caches at `folder/torch-<version>-cuda-<version>/` (set before the first compile),
    and let the AOT autograd cache take the model's graphs (`AUTOCAST_IN_GRAPH`), whatever the folder.
    A TORCHINDUCTOR_CACHE_DIR of the user's wins; torch's own default does not count as one (importing
    diffusers, for one, makes torch write its default, the node's temporary folder, into the environment)."""
    import torch._inductor.config as inductor_config  # torch.compile imports it next anyway

    if hasattr(inductor_config, "unsafe_marked_cacheable_functions"):  # torch >= 2.8 (< 2.12 lists them safe)
        marked = dict.fromkeys(AUTOCAST_IN_GRAPH, torch.__version__)
        inductor_config.unsafe_marked_cacheable_functions = {
            **inductor_config.unsafe_marked_cacheable_functions, **marked}
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder is None or (given and given != _default_inductor_cache()):
        return None
    key = re.sub(r"[^A-Za-z0-9.+_-]", "_", f"torch-{torch.__version__}-cuda-{torch.version.cuda or 'none'}"
                 f"-ops-{_custom_ops_digest()}")
    path = Path(folder) / key
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only share: compile as before, in the node's temporary folder
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def _custom_ops_digest() -> str:
    """The code of the model's custom ops: torch's caches key a compiled graph by the ops' names, not by
    the Python behind them (their backward formula is traced from it), so a changed op gets a new folder.
    (The Triton kernels run from rgb_head_kernels.py at call time: never stale, not hashed.)"""
    from taehv_slurm.trainer import first_conv, layers, rgb_head

    digest = hashlib.sha256()
    for module in (layers, rgb_head, first_conv):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:12]


def _default_inductor_cache() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # torch >= 2.6
    except ImportError:
        from torch._inductor.runtime.runtime_utils import default_cache_dir  # torch 2.4, 2.5
    return default_cache_dir()
