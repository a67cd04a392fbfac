"""What ran in each attempt of a run, recorded by rank 0 as the attempt starts:

    RunFolder.attempts            one line per attempt: job id, restart, step, hosts, the code (git
                                  commit, dirty or not), versions, and the resolved training config
    RunFolder.code                `<job>_<restart>.diff`: the uncommitted changes of a dirty tree
                                  (`git diff HEAD`)

The code is the git work tree the taehv_slurm package was imported from (a checkout installed with
`pip install -e .`), or the copy of it a Slurm job runs (taehv_slurm.snapshot: its SNAPSHOT_FILE
says which tree, commit and diff it copied); an installed wheel has no tree, and its version says what
ran. Read back by
`JobHandle.config_history()`, `taehv status` (the commit column) and the submit-time resume check.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from taehv_slurm.common.runfolder import RunFolder, write_text_atomic

SNAPSHOT_FILE = ".taehv-snapshot.json"  # atop the copy of the code a job runs (taehv_slurm.snapshot)
DIFF_LIMIT_BYTES = 4 << 20  # a larger diff is cut there (and says so): it is a record, not a patch store
GIT_TIMEOUT_S = 10
PACKAGES = ("torch", "deepspeed", "submitit", "taehv-slurm")


def record_attempt(run_dir: str | os.PathLike, job_id: str, restart: int, segment: int | None, step: int,
                   config: Mapping[str, Any] | None,
                   network: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Append this attempt's record (rank 0, at its start); returns it. Never raises for a missing git.
    `network`: how its ranks talk between nodes (taehv_slurm.runtime.network.transport)."""
    run_dir = Path(run_dir)
    code = code_state(Path(__file__).resolve().parents[1])
    diff = code.pop("diff", "")
    if diff:
        folder = RunFolder(run_dir).code
        folder.mkdir(exist_ok=True)
        path = folder / f"{job_id}_{restart}.diff"
        write_text_atomic(path, diff, 0o600)
        code["diff_file"] = path.relative_to(run_dir).as_posix()
    record = {"job_id": str(job_id), "restart": restart, "segment": segment, "step": step, "hosts": hosts(),
              "code": code, "versions": versions(), "config": dict(config or {}),
              **({"network": dict(network)} if network else {})}
    RunFolder(run_dir).attempts().write("attempt", **record)
    return record


def read_attempts(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every attempt's record, oldest first ([] for a run that never started, or of an older release)."""
    return [e for e in RunFolder(run_dir).attempts().read() if e.get("event") == "attempt"]


def commit_label(attempts: Sequence[Mapping[str, Any]]) -> str | None:
    """The code of a run's attempts for a status row: 'a1b2c3d4' ('+dirty' for uncommitted changes), and
    'a1b2c3d4→e5f6a7b8' when it changed between attempts; None when no attempt recorded a commit."""
    labels = []
    for attempt in attempts:
        code = attempt.get("code") or {}
        if code.get("commit"):
            labels.append(code["commit"][:8] + ("+dirty" if code.get("dirty") else ""))
    labels = list(dict.fromkeys(labels))
    if not labels:
        return None
    return labels[0] if len(labels) == 1 else f"{labels[0]}→{labels[-1]}"


def code_state(package_dir: Path) -> dict[str, Any]:
    """{"tree", "commit", "dirty", "diff"} of the git work tree holding `package_dir` (for a copy of one,
    what the copy recorded, and "snapshot": the copy's folder); {"tree": None} where there is none (an
    installed wheel) or git is missing."""
    for folder in (package_dir, *package_dir.parents):
        if (folder / SNAPSHOT_FILE).is_file():
            with contextlib.suppress(OSError, ValueError):
                copied = json.loads((folder / SNAPSHOT_FILE).read_text())
                return {**{k: copied.get(k) for k in ("tree", "commit", "dirty")},
                        "diff": copied.get("diff") or "", "snapshot": str(folder)}
    top = _git(package_dir, "rev-parse", "--show-toplevel")
    if top is None:
        return {"tree": None, "commit": None, "dirty": None}
    commit = _git(package_dir, "rev-parse", "HEAD")
    changed = _git(package_dir, "status", "--porcelain", "--untracked-files=no")
    diff = _git(package_dir, "diff", "HEAD") if changed else ""
    if diff and len(diff) > DIFF_LIMIT_BYTES:
        diff = diff[:DIFF_LIMIT_BYTES] + f"\n[cut at {DIFF_LIMIT_BYTES} bytes]\n"
    return {"tree": top, "commit": commit, "dirty": bool(changed) if changed is not None else None,
            "diff": diff or ""}


def versions() -> dict[str, Any]:
    """Python and the packages that shape a run; CUDA and the driver where there is a GPU."""
    found: dict[str, Any] = {"python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    torch = sys.modules.get("torch")  # the trainer has imported it by now; never imported here
    if torch is not None:
        found["cuda"] = torch.version.cuda
    found["driver"] = _nvidia_driver()
    return found


def hosts() -> list[str]:
    """The nodes of this job (Slurm's node list), else this machine."""
    from taehv_slurm.runtime.ranks import node_name

    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if nodelist:
        with contextlib.suppress(Exception):
            import hostlist

            return list(hostlist.expand_hostlist(nodelist))
    return [node_name()]


def _nvidia_driver() -> str | None:
    with contextlib.suppress(OSError):
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."
        text = Path("/proc/driver/nvidia/version").read_text()
        for word in text.split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    return None


def _git(where: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
