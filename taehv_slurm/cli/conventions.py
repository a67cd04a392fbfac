"""The conventions every command follows: default config paths, the shortcut flags, exit codes, and one-line
errors instead of tracebacks.

Config paths such as `configs/train/tiny.yaml` work from any folder: the library falls back to the
example configs installed with the package (taehv_slurm.common.config.shipped_config).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator

from taehv_slurm.common.config import ClusterConfig, load_cluster

DEFAULT_CLUSTER = "configs/cluster/h100_8gpu.yaml"
LOCAL_CLUSTER = "configs/cluster/local.yaml"
DEFAULT_TRAIN = "configs/train/taehv.yaml"
DEFAULT_JOB_DIR = "runs"


def default_job_dir() -> str:
    return os.environ.get("TAEHV_JOB_DIR") or DEFAULT_JOB_DIR


def add_job_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job-dir", default=default_job_dir(),
                   help="the cluster config's job_dir (default $TAEHV_JOB_DIR or runs)")


def add_cluster_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, local: bool,
                      nodes_required: bool = False, time_min: bool = True,
                      set_help: str = "override any cluster or train key") -> None:
    """The flags that pick and shape a cluster config, the same in every command that submits or checks a
    job: --cluster (`local`: the local config with --local), --nodes, --gpus-per-node, --partition,
    --time-min, --set. cluster_flag_overrides and flag_origins read them."""
    default = None if local else DEFAULT_CLUSTER
    p.add_argument("--cluster", default=default,
                   help=f"cluster YAML (default {DEFAULT_CLUSTER}" + (f"; {LOCAL_CLUSTER} with --local)"
                                                                     if local else ")"))
    p.add_argument("--nodes", type=int, required=nodes_required,
                   help="number of nodes (each runs one rank per GPU)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default from the cluster config)")
    p.add_argument("--partition", help="Slurm partition (default from the cluster config)")
    if time_min:
        p.add_argument("--time-min", type=int,
                       help="time limit in minutes (the job requeues itself past it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)


SHORTCUTS = {"nodes": "--nodes", "gpus_per_node": "--gpus-per-node", "partition": "--partition",
             "time_min": "--time-min", "max_parallel": "--max-parallel", "spare_nodes": "--spare-nodes"}


def cluster_flag_overrides(args: argparse.Namespace, cluster_over: dict) -> dict:
    """Fold the shortcut flags --nodes/--gpus-per-node/--partition/--time-min/--max-parallel/--spare-nodes
    (those a CLI has) into cluster overrides."""
    for key in SHORTCUTS:
        if getattr(args, key, None) is not None:
            cluster_over["array_parallelism" if key == "max_parallel" else key] = getattr(args, key)
    gpus = getattr(args, "gpus_per_node", None)
    if gpus is not None and "tasks_per_node" not in cluster_over:
        cluster_over["tasks_per_node"] = gpus or 1  # one task per GPU
    return cluster_over


def flag_origins(args: argparse.Namespace) -> dict[str, str]:
    """Config key → the flag that set it, as typed: errors in those values name the flag, not the YAML."""
    origins = {item.partition("=")[0].strip(): f"--set {item}" for item in getattr(args, "set", None) or []}
    for key, flag in SHORTCUTS.items():
        if getattr(args, key, None) is not None:
            origins["array_parallelism" if key == "max_parallel" else key] = f"{flag} {getattr(args, key)}"
    if getattr(args, "gpus_per_node", None) is not None:
        origins.setdefault("tasks_per_node", origins["gpus_per_node"])
    if getattr(args, "local", False):
        origins.setdefault("backend", "--local")
    return origins


def load_cluster_from_args(args: argparse.Namespace, cluster_over: dict) -> ClusterConfig:
    """The cluster config a submitting CLI's flags pick: --cluster, else the local config with --local,
    else the default; with the shortcut flags and --set applied. --cluster with --local runs that
    cluster's settings on the local backend."""
    cluster_flag_overrides(args, cluster_over)
    if args.local and args.cluster:
        cluster_over.setdefault("backend", "local")
    return load_cluster(args.cluster or (LOCAL_CLUSTER if args.local else DEFAULT_CLUSTER),
                        origins=flag_origins(args),
                        **cluster_over)


# Every command's exit codes (docs/errors.md, "Exit codes"): done; the run failed; refused before anything
# ran (bad input, a failed check, no Slurm); stopped by a signal: 128 + its number, as a shell reports it
# (130 Ctrl-C, 143 SIGTERM).
EXIT_DONE, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2


def stopped_exit_code(signum: int) -> int:
    return 128 + signum


class Terminated(KeyboardInterrupt):
    """A SIGTERM to the CLI while it follows a job: handled as Ctrl-C is, said in its own words, exit 143."""

    signum = signal.SIGTERM


def stop_signal(stop: KeyboardInterrupt) -> int:
    """The signal a KeyboardInterrupt stands for: SIGTERM for `Terminated`, else Ctrl-C's SIGINT."""
    return getattr(stop, "signum", signal.SIGINT)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """A SIGTERM to the CLI (`kill`, `timeout`, a stopping container) acts as Ctrl-C does while it follows a
    job: a job running on this machine is stopped and saved, not left running without it (its ranks run in
    their own session, so only the CLI hears the signal). It raises `Terminated`: the command exits 143."""
    def interrupt(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def one_line_errors(main: Callable[..., int | None]) -> Callable[..., int | None]:
    """Print known user errors as `error: ...` and exit 2 (EXIT_REFUSED); everything else keeps its
    traceback. A Ctrl-C or a SIGTERM that reaches here exits 130 or 143. The error classes are imported
    only when something was raised: a command that succeeds loads none of the modules they live in."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        warnings.showwarning = _one_line_warning
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt as stop:
            signum = stop_signal(stop)
            print("terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted", file=sys.stderr)
            return stopped_exit_code(signum)
        except Exception as err:
            from taehv_slurm.submit_checks import ChecksFailedError

            if isinstance(err, ChecksFailedError):  # every problem of the submit, one line each
                for problem in err.problems:
                    print(f"error: {problem}", file=sys.stderr)
                return EXIT_REFUSED
            if isinstance(err, _user_errors()):
                print(f"error: {err}", file=sys.stderr)
                return EXIT_REFUSED
            if isinstance(err, OSError) and err.filename is not None:
                # a folder the CLI creates or writes (job_dir, run folders): read-only, no permission
                print(f"error: {err.filename}: {err.strerror}; check that path and its permissions "
                      "(run folders go under job_dir in the cluster config: --set job_dir=DIR on storage "
                      "every node sees)", file=sys.stderr)
                return EXIT_REFUSED
            raise

    return wrapper


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors a user's input or environment causes, which the commands print in one line."""
    from taehv_slurm.common.config import ConfigError
    from taehv_slurm.common.security import UnsafePathError
    from taehv_slurm.executor import SubmissionError
    from taehv_slurm.picklecheck import UnpicklableTaskError
    from taehv_slurm.registry import UnknownJobError
    from taehv_slurm.runtime.checkpoint import CheckpointError
    from taehv_slurm.runtime.distenv import DistributedSetupError
    from taehv_slurm.submission import RunBusyError

    return (ConfigError, DistributedSetupError, SubmissionError, UnknownJobError, UnsafePathError,
            CheckpointError, FileNotFoundError, UnpicklableTaskError, RunBusyError)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)
