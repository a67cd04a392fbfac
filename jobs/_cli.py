"""Shared by the CLIs: config paths that work from any folder, and one-line errors instead of tracebacks."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

from taehv_slurm.config import ClusterConfig, load_cluster

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CLUSTER = "configs/cluster/h100_8gpu.yaml"
LOCAL_CLUSTER = "configs/cluster/local.yaml"
DEFAULT_TRAIN = "configs/train/taehv.yaml"


def resolve(path: str | None) -> str | None:
    """A config path as given, or relative to the repository when it is not found from here."""
    if path is None or Path(path).exists():
        return path
    candidate = REPO / path
    return str(candidate) if candidate.exists() else path


def cluster_flag_overrides(args, cluster_over: dict) -> dict:
    """Fold the shortcut flags --nodes/--gpus-per-node/--partition/--time-min (those a CLI has) into
    cluster overrides."""
    for key in ("nodes", "gpus_per_node", "partition", "time_min"):
        if getattr(args, key, None) is not None:
            cluster_over[key] = getattr(args, key)
    gpus = getattr(args, "gpus_per_node", None)
    if gpus is not None and "tasks_per_node" not in cluster_over:
        cluster_over["tasks_per_node"] = gpus or 1  # one task per GPU
    return cluster_over


def load_cluster_from_args(args, cluster_over: dict) -> ClusterConfig:
    """The cluster config a submitting CLI's flags pick: --cluster, else the local config with --local,
    else the default; with the shortcut flags and --set applied. --cluster with --local runs that
    cluster's settings on the local backend."""
    cluster_flag_overrides(args, cluster_over)
    if args.local and args.cluster:
        cluster_over.setdefault("backend", "local")
    return load_cluster(resolve(args.cluster or (LOCAL_CLUSTER if args.local else DEFAULT_CLUSTER)), **cluster_over)


def one_line_errors(main: Callable[..., int | None]) -> Callable[..., int | None]:
    """Print known user errors as `error: ...` and exit 2; everything else keeps its traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        from taehv_slurm.checkpoint import CheckpointError
        from taehv_slurm.config import ConfigError
        from taehv_slurm.distenv import DistributedSetupError
        from taehv_slurm.executor import SubmissionError
        from taehv_slurm.handle import UnknownJobError
        from taehv_slurm.picklecheck import UnpicklableTaskError
        from taehv_slurm.security import UnsafePathError

        try:
            return main(*args, **kwargs)
        except (ConfigError, DistributedSetupError, SubmissionError, UnknownJobError, UnsafePathError,
                CheckpointError, FileNotFoundError, UnpicklableTaskError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except OSError as err:  # a folder the CLI creates or writes (job_dir, run folders): read-only, no permission
            if err.filename is None:
                raise
            print(f"error: {err.filename}: {err.strerror}; check that path and its permissions (run folders go "
                  "under job_dir in the cluster config: --set job_dir=DIR on storage every node sees)", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return wrapper
