"""The compiled student loaded whole from the compile cache: a warm start without Dynamo's tracing.

torch.compile traces the model's Python again at every start, warm cache or not: 3.8 s of a 17.7-s warm
start on an H100 (docs/benchmarks.md). torch's AOT compile (`aot_compile`; tested with torch 2.11 on GPUs
and 2.13 on CPUs) saves the traced and compiled forward and backward as one file, which a later start loads
and runs without tracing.

One file per input shape, under the compile cache (`<TORCHINDUCTOR_CACHE_DIR>/precompiled/`). The file keeps
the guards on the inputs and on the module (its parameters' shapes, its constants), checked at the first
run; torch leaves out the guards on globals, so the file's name is a digest of what they stood for (the
trainer's code, torch's version, the device, the compile options and Inductor's settings, the autocast
state, the fast paths), and of the module and the inputs too, so that runs of two configs on one cache each
keep their own. Anything that fails (a torch without the API, a file it cannot read, a first run that fails)
compiles again or runs torch.compile for that shape, with one log line; a file that failed is removed.

Where no file has a shape yet (a cold start), the student trains eager while another process compiles it
(`compile_aside`; `python -m taehv_slurm.trainer.compile_aside JOB`, the module and the inputs' shapes handed
over in a file), and each micro-batch after the file appears runs it: the first step comes after an eager
step instead of after the whole compile. If that process fails, this one compiles as before (its log is kept
beside the files).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taehv_slurm.common.messages import one_line
from taehv_slurm.trainer.layers import FAST_PATHS

log = logging.getLogger("taehv")
SUBFOLDER = "precompiled"


def code_digest() -> str:
    """The trainer package's code (the model, its layers, kernels and losses are all in it)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def compiler_settings() -> list[Any]:
    """Inductor's and AOT autograd's settings (a user's TORCHINDUCTOR_* variables among them), as torch's own
    caches key on them: a file compiled under other settings is not the program these would compile. Paths,
    thread counts and the like are left out by torch (`save_config_portable`), so every rank, node and
    allocation of a job finds the same files."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return [sorted(config.save_config_portable().items()) for config in (inductor_config, functorch_config)]


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
        self.module, self.folder, self.compiled = module, folder, compiled
        self.options = torch._inductor.list_mode_options(mode)
        self.device = next(module.parameters()).device
        paths = sorted((k, v) for k, v in FAST_PATHS.items() if k != "compile_aside")  # where, not what
        self.fixed = repr([code_digest(), torch.__version__, str(torch.version.cuda), mode, paths,
                           compiler_settings(), module_signature(module),
                           torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"])
        self.by_shape: dict[str, Callable[..., Any] | None] = {}
        # per input shape: "loaded", "saved", "compiled aside", "torch.compile", or while it runs eager,
        # ASIDE or "eager" (its compile aside ended by a SIGTERM)
        self.outcomes: dict[str, str] = {}
        self.proven: set[str] = set()  # the shapes whose function has run once
        self.aside: dict[str, Aside] = {}  # the shapes another process is compiling
        self.stopped: dict[str, float] = {}  # shapes whose compile aside a SIGTERM ended: eager until then

    def __call__(self, *inputs: torch.Tensor) -> Any:
        key = self.key(inputs)
        if key not in self.by_shape and not self.ready(key, inputs):
            return self.module(*inputs)  # eager while another process compiles this shape
        fn = self.by_shape[key]
        if fn is None:
            return self.compiled(*inputs)
        if key in self.proven:
            return fn(self.module, *inputs)
        try:
            out = fn(self.module, *inputs)
        except Exception as err:  # noqa: BLE001 (its first run: a saved guard that fails, anything torch does)
            path = self.file(key)
            path.unlink(missing_ok=True)  # never loaded again
            again = self.outcomes[key] in ("loaded", "compiled aside")  # compiled by another process
            log.warning("the compiled student %s failed its first run (%s); %s", path, one_line(err),
                        "compiling it again" if again else "torch.compile runs this shape")
            self.settle(key, self.compile(key, inputs) if again else None, "saved")
            return self(*inputs)
        self.proven.add(key)
        return out

    def ready(self, key: str, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Settle the shape `key` if its function can be had now; False while it is compiled aside."""
        aside = self.aside.get(key)
        if aside is None:  # the first call of this shape, or the first after its compile aside was stopped
            if self.stopped.get(key, 0.0) > time.monotonic():
                return False
            if loaded := self.load(key):
                self.settle(key, loaded, "loaded")
                return True
            if FAST_PATHS["compile_aside"] and (aside := Aside.start(self, key, inputs)) is not None:
                self.aside[key] = aside
                self.outcomes[key] = ASIDE
                return False
            self.settle(key, self.compile(key, inputs), "saved")
            return True
        if not aside.due():
            return False
        if self.file(key).is_file():  # renamed into place whole, by that process or another rank's
            if loaded := self.load(key):
                del self.aside[key]
                self.settle(key, loaded, "compiled aside")
                return True
        elif aside.running():
            return False
        del self.aside[key]
        aside.job.unlink(missing_ok=True)  # if it ended before reading it
        ended = aside.proc.poll()  # None: it runs on, but its file did not load
        if ended is not None and -ended in (signal.SIGTERM, signal.SIGINT):  # the job's end, most likely: no
            # compile here in the time left to save; one aside again later if this process goes on
            log.warning("the compile aside was stopped (signal %d); the student runs eager, compiled aside "
                        "again in %.0f s if this process goes on", -ended, Aside.RETRY_S)
            self.stopped[key] = time.monotonic() + Aside.RETRY_S
            self.outcomes[key] = "eager"
            return False
        log.warning("the student was not compiled aside (log: %s); compiling it in this process", aside.log)
        self.settle(key, self.compile(key, inputs), "saved")
        return True

    def settle(self, key: str, fn: Callable[..., Any] | None, outcome: str) -> None:
        """What runs the shape `key` from now on: `fn` (`outcome`: loaded or saved), or torch.compile."""
        self.by_shape[key] = fn
        self.outcomes[key] = outcome if fn is not None else "torch.compile"

    def key(self, inputs: tuple[torch.Tensor, ...]) -> str:
        shapes = [(tuple(t.shape), str(t.dtype), t.stride(), str(t.device)) if torch.is_tensor(t) else repr(t)
                  for t in inputs]
        # the rest fixed at build
        described = repr([self.fixed, self.module.training, shapes, autocast_state(self.device)])
        return hashlib.sha256(described.encode()).hexdigest()[:32]

    def file(self, key: str) -> Path:
        return self.folder / f"{key}.bin"

    def load(self, key: str) -> Callable[..., Any] | None:
        path = self.file(key)
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
        return compile_and_save(self.module, self.options, self.file(key), inputs)


def compile_and_save(module: nn.Module, options: dict[str, Any], path: Path,
                     inputs: tuple[torch.Tensor, ...]) -> Callable[..., Any] | None:
    """`module`'s forward compiled for `inputs` (torch's AOT compile) and saved to `path`; None if torch
    could not compile it so (the caller runs torch.compile)."""
    # torch cannot save a parameter's .grad with the guards (the engine's gradient windows): None while
    # tracing, put back after; the compiled graph never reads them.
    grads = [(p, p.grad) for p in module.parameters()]
    try:
        for p, _ in grads:
            p.grad = None
        with torch._dynamo.config.patch(enable_aot_compile=True):  # torch 2.11: off by default
            fn = torch.compile(module.forward, fullgraph=True, dynamic=False,
                               options={**options, "guard_filter_fn": saved_guards}).aot_compile((inputs, {}))
    except Exception as err:  # noqa: BLE001 (an older torch, a graph it cannot save: as before)
        log.warning("the student could not be precompiled (%s); torch.compile traces it at every start",
                    one_line(err))
        return None
    finally:
        for p, g in grads:
            p.grad = g
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
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


ASIDE = "eager, compiling aside"


class Aside:
    """One shape compiled by another process (`compile_job`): the module (pickled, its weights with it) and
    the inputs' shapes, dtypes and strides go over in a file; the process saves the compiled function where
    `PrecompiledForward.load` finds it, removes its log and exits. It ends when this process ends."""

    POLL_S = 1.0  # how often a micro-batch looks for the file
    RETRY_S = 60.0  # after a SIGTERM ended it, if the rank goes on (it was not the job's end)

    def __init__(self, proc: subprocess.Popen, job: Path, log: Path) -> None:
        self.proc, self.job, self.log, self.checked = proc, job, log, time.monotonic()

    @classmethod
    def start(cls, owner: PrecompiledForward, key: str, inputs: tuple[Any, ...]) -> Aside | None:
        job = owner.folder / f".{key}.aside-{os.getpid()}.pt"
        log_path = owner.folder / f"{key}.aside-{os.getpid()}.log"
        device = owner.device
        spec = [("tensor", tuple(x.shape), x.stride(), x.dtype) if torch.is_tensor(x) else ("value", x)
                for x in inputs]
        try:
            owner.folder.mkdir(parents=True, exist_ok=True)
            torch.save({"module": owner.module, "inputs": spec, "options": owner.options,
                        "device": str(device), "autocast": autocast_state(device), "state": global_state(),
                        "fast_paths": dict(FAST_PATHS), "path": str(owner.file(key)), "log": str(log_path),
                        "parent": os.getpid()}, job)
            # Slurm signals every process of a step: the requeue signals are the rank's to act on (save,
            # requeue), so the process starts with them blocked (a signal mask outlives exec), from its
            # first instruction on. A SIGTERM (preemption, the time limit) ends it.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
            path = os.pathsep.join(filter(None, sys.path))  # this process's: the module's classes are there
            try:
                # from the main thread, bound to this process's life (a parent-death signal is bound to
                # the thread that started the child)
                bind = [str(os.getpid())] if threading.current_thread() is threading.main_thread() else []
                command = [sys.executable, "-m", "taehv_slurm.trainer.compile_aside", str(job), *bind]
                with open(log_path, "w") as out:
                    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        except Exception as err:  # noqa: BLE001 (a full or read-only cache, no fork: compile here instead)
            log.warning("the student could not be compiled aside (%s); compiling it in this process",
                        one_line(err))
            job.unlink(missing_ok=True)
            return None
        log.info("the student trains eager while process %d compiles it (log: %s)", proc.pid, log_path)
        return cls(proc, job, log_path)

    def due(self) -> bool:
        """Whether to look again: once a second, not at every micro-batch (a shared filesystem's stat)."""
        now = time.monotonic()
        if now - self.checked < self.POLL_S:
            return False
        self.checked = now
        return True

    def running(self) -> bool:
        return self.proc.poll() is None


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    """The autocast mode a compiled function is made for (part of its file's name)."""
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def global_state() -> dict[str, Any]:
    """What Dynamo's guard on global state checks besides the grad and autocast modes: a function compiled
    under another state (another torch.set_num_threads, as a rank sets it) fails that guard at its first
    run."""
    matmul = torch.backends.cuda.matmul
    return {"num_threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "fp16_reduce": matmul.allow_fp16_reduced_precision_reduction,
            "bf16_reduce": matmul.allow_bf16_reduced_precision_reduction}


def set_global_state(state: dict[str, Any]) -> None:
    torch.set_num_threads(state["num_threads"])
    torch.set_default_dtype(state["default_dtype"])
    torch.use_deterministic_algorithms(state["deterministic"], warn_only=state["warn_only"])
    torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = state["fp16_reduce"]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = state["bf16_reduce"]


def compile_job(job_path: str) -> None:
    """Compile the shape `Aside.start` described and save it (its own process: trainer/compile_aside.py)."""
    job = torch.load(job_path, weights_only=False)  # the module's tensors on the rank's device, as there
    Path(job_path).unlink()
    parent = job["parent"]

    def end_with_parent() -> None:  # a rank that ends takes its compile with it (where prctl did not)
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=end_with_parent, daemon=True).start()
    from taehv_slurm.trainer.speed import use_compile_cache

    FAST_PATHS.update(job["fast_paths"])
    set_global_state(job["state"])
    use_compile_cache(None)  # the folder is in the environment already; this marks what its caches may keep
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    inputs = tuple(torch.empty_strided(item[1], item[2], dtype=item[3], device=device) if item[0] == "tensor"
                   else item[1] for item in job["inputs"])
    enabled, dtype = job["autocast"]
    path = Path(job["path"])
    with torch.autocast(device.type, dtype=dtype, enabled=enabled):
        fn = compile_and_save(job["module"], job["options"], path, inputs)
    if fn is None or not path.is_file():
        sys.exit(1)  # its log stays: the rank names it
    Path(job["log"]).unlink(missing_ok=True)


def precompiled_folder() -> Path:
    """Where the files go: beside Inductor's own caches (use_compile_cache has pointed them at the job's)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / SUBFOLDER

