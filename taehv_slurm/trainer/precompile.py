"""The compiled student loaded whole from the compile cache: a warm start without Dynamo's tracing.

torch.compile traces the model's Python again at every start, warm cache or not: 3.8 s of a 17.7-s warm
start on an H100 (docs/benchmarks.md). torch's AOT compile (`aot_compile`; tested with torch 2.11 on GPUs
and 2.13 on CPUs) saves the traced and compiled forward and backward as one file, which a later start loads
and runs without tracing.

One file per input shape, under the compile cache (`<TORCHINDUCTOR_CACHE_DIR>/precompiled/`). The file keeps
the guards on the inputs and on the module (its parameters' shapes, its constants), checked at the first
run; torch leaves out the guards on globals, so the file's name is a digest of what they stood for (the
trainer's code, torch's version, the device, the compile options, the autocast state, the fast paths), and
of the module and the inputs too, so that runs of two configs on one cache each keep their own. Anything
that fails (a torch without the API, a file it cannot read, a first run that fails) compiles again or runs
torch.compile for that shape, with one log line; a file that failed is removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taehv_slurm.common.messages import one_line

log = logging.getLogger("taehv")
SUBFOLDER = "precompiled"


def code_digest() -> str:
    """The trainer package's code (the model, its layers, kernels and losses are all in it)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def module_signature(module: nn.Module) -> list[Any]:
    """What Dynamo would guard on in the module: each parameter's and buffer's name, shape, dtype, stride
    and device, and each submodule's plain attributes (the loss weights, the training flag, ...)."""
    plain = (bool, int, float, str, tuple, type(None), torch.dtype)
    tensors = [(n, tuple(t.shape), str(t.dtype), t.stride(), str(t.device), t.requires_grad)
               for n, t in [*module.named_parameters(), *module.named_buffers()]]
    attrs = [(name, sorted((k, repr(v)) for k, v in vars(m).items() if not k.startswith("_")
                           and isinstance(v, plain)))
             for name, m in module.named_modules()]
    return [tensors, attrs]


class PrecompiledForward:
    """`module`'s forward, compiled once per input shape and kept in the compile cache (`folder`); each
    later process loads it. `compiled` (torch.compile of the module) runs a shape that could not be."""

    def __init__(self, module: nn.Module, mode: str, folder: Path, compiled: Callable[..., Any]) -> None:
        from taehv_slurm.trainer.layers import FAST_PATHS

        self.module, self.folder, self.compiled = module, folder, compiled
        self.options = torch._inductor.list_mode_options(mode)
        self.device = next(module.parameters()).device
        self.fixed = repr([code_digest(), torch.__version__, str(torch.version.cuda), mode,
                           sorted(FAST_PATHS.items()), module_signature(module),
                           torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"])
        self.by_shape: dict[str, Callable[..., Any] | None] = {}
        self.outcomes: dict[str, str] = {}  # per input shape: "loaded", "saved" or "torch.compile"
        self.proven: set[str] = set()  # the shapes whose function has run once

    def __call__(self, *inputs: torch.Tensor) -> Any:
        key = self.key(inputs)
        if key not in self.by_shape:
            loaded = self.load(key)
            if loaded:
                self.settle(key, loaded, "loaded")
            else:
                self.settle(key, self.compile(key, inputs), "saved")
        fn = self.by_shape[key]
        if fn is None:
            return self.compiled(*inputs)
        if key in self.proven:
            return fn(self.module, *inputs)
        try:
            out = fn(self.module, *inputs)
        except Exception as err:  # noqa: BLE001 (its first run: a saved guard that fails, anything torch does)
            path = self.folder / f"{key}.bin"
            path.unlink(missing_ok=True)  # never loaded again
            loaded = self.outcomes[key] == "loaded"
            log.warning("the compiled student %s failed its first run (%s); %s", path, one_line(err),
                        "compiling it again" if loaded else "torch.compile runs this shape")
            self.settle(key, self.compile(key, inputs) if loaded else None, "saved")
            return self(*inputs)
        self.proven.add(key)
        return out

    def settle(self, key: str, fn: Callable[..., Any] | None, outcome: str) -> None:
        """What runs the shape `key` from now on: `fn` (`outcome`: loaded or saved), or torch.compile."""
        self.by_shape[key] = fn
        self.outcomes[key] = outcome if fn is not None else "torch.compile"

    def key(self, inputs: tuple[torch.Tensor, ...]) -> str:
        shapes = [(tuple(t.shape), str(t.dtype), t.stride(), str(t.device)) if torch.is_tensor(t) else repr(t)
                  for t in inputs]
        autocast = (torch.is_autocast_enabled(self.device.type), torch.get_autocast_dtype(self.device.type))
        described = repr([self.fixed, self.module.training, shapes, autocast])  # the rest fixed at build
        return hashlib.sha256(described.encode()).hexdigest()[:32]

    def load(self, key: str) -> Callable[..., Any] | None:
        path = self.folder / f"{key}.bin"
        if not path.is_file():
            return None
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f)
        except Exception as err:  # noqa: BLE001 (any failure: compile as if none were saved)
            log.warning("the compiled student in %s did not load (%s); compiling it again", path,
                        one_line(err))
            return None

    def compile(self, key: str, inputs: tuple[torch.Tensor, ...]) -> Callable[..., Any] | None:
        # torch cannot save a parameter's .grad with the guards (the engine's gradient windows): None while
        # tracing, put back after; the compiled graph never reads them.
        grads = [(p, p.grad) for p in self.module.parameters()]
        try:
            for p, _ in grads:
                p.grad = None
            with torch._dynamo.config.patch(enable_aot_compile=True):  # torch 2.11: off by default
                fn = torch.compile(self.module.forward, fullgraph=True, dynamic=False,
                                   options={**self.options, "guard_filter_fn": saved_guards}
                                   ).aot_compile((inputs, {}))
        except Exception as err:  # noqa: BLE001 (an older torch, a graph it cannot save: as before)
            log.warning("the student could not be precompiled (%s); torch.compile traces it at every start",
                        one_line(err))
            return None
        finally:
            for p, g in grads:
                p.grad = g
        path = self.folder / f"{key}.bin"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(tmp))
            os.replace(tmp, path)
        except Exception as err:  # noqa: BLE001 (a full or read-only cache: this process still runs it)
            log.warning("the compiled student was not saved to %s (%s)", path, err)
            tmp.unlink(missing_ok=True)
        return fn


def saved_guards(entries: list[Any]) -> list[bool]:
    """The guards a file keeps: all but those on globals and those torch cannot save (torch 2.13's default;
    2.11 needs it said)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())
    return [not e.is_global and e.guard_type not in unsupported for e in entries]


def precompiled_folder() -> Path:
    """Where the files go: beside Inductor's own caches (use_compile_cache has pointed them at the job's)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / SUBFOLDER
