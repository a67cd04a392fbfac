"""Python's bytecode for the ranks where the environment turns it off.

Container images often set PYTHONDONTWRITEBYTECODE=1, and uv (or `pip install --no-compile`) installs
packages without their .pyc files. Together they make every rank of every attempt compile torch's Python
source again before it can start: on an H200 machine that was 6 to 7 s of a 20-s warm start
(docs/benchmarks.md). Where torch has no bytecode and Python may not write any, a rank keeps it in the
job's compile cache instead, through Python's pycache prefix (a mirror tree of the sources: nothing is
written beside the installed files), and every later rank and attempt loads it from there. Python checks
each cached file against its source's size and time, so an upgraded package never runs stale bytecode.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

COMPILE_CACHE_ENV = "TAEHV_COMPILE_CACHE"  # the job's compile cache, exported to its tasks (executor)
SUBFOLDER = "python-bytecode"


def keep_bytecode(compile_cache: str | os.PathLike | None, package: str = "torch") -> Path | None:
    """Before `package` is imported: when Python may not write bytecode, none is set to be kept elsewhere
    and `package` has none, write and read this process's bytecode under `compile_cache/python-bytecode/`,
    and so do its children (data-loader and compile workers); the rank's log says so. Returns that folder,
    or None (nothing changed). A folder that cannot be written costs nothing: Python only compiles, as
    before."""
    if not compile_cache or not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return None
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.cached or os.path.exists(spec.cached):
        return None
    folder = Path(compile_cache) / SUBFOLDER
    sys.pycache_prefix, sys.dont_write_bytecode = str(folder), False
    # The children's: they write under the prefix too, never beside the sources (what the variable was for).
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    print(f"[taehv] PYTHONDONTWRITEBYTECODE is set and {package} has no bytecode: keeping it in {folder}",
          flush=True)
    return folder
