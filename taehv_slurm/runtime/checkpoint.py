"""Atomic checkpoints: a crash at any instant leaves `latest` loadable and never partial.

Layout of a checkpoint folder:

    checkpoints/
      step_00001200/        one complete checkpoint (renamed into place only once fully written)
        state.pt            tensors and plain values only: loads with torch.load(weights_only=True)
        meta.json           step, time, config and plan it ran under
      latest                text file naming the newest complete checkpoint (replaced atomically)

A save writes `step_N.tmp-<random>/`, fsyncs each file and the folder, renames it to `step_N`,
fsyncs the parent, then replaces `latest` the same way. Old checkpoints beyond `keep` are removed
only after the new `latest` is durable. The state is engine-independent (full tensors by parameter
name), so a run resumes at any world size and with any engine.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from taehv_slurm.common.messages import first_line
from taehv_slurm.common.runfolder import fsync_dir, write_text_atomic
from taehv_slurm.common.security import check_safe_to_load, make_private_dir

_STEP_DIR = re.compile(r"^step_(\d+)$")
# Why a save failed where the same folder refuses it again whichever node retries it (a restart cannot mend
# it), and what mends it.
LASTING_FIXES = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there or ask for a larger quota",
                 errno.EROFS: "have that filesystem made writable",
                 errno.EACCES: "fix that folder's permissions", errno.EPERM: "fix that folder's permissions"}

NO_ROOM_BYTES = 2**20  # free space under which a filesystem counts as full (for `Checkpointer.no_room`)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says what was kept and what to do.
    `lasting`: a save that failed for a reason a restart cannot mend (`LASTING_FIXES`)."""

    def __init__(self, message: str, cause: str = "", lasting: bool = False) -> None:
        super().__init__(message)
        self.cause = cause or message
        self.lasting = lasting


class Checkpointer:
    """Save and load checkpoints under `directory`, keeping the last `keep` of them.

    `save(..., blocking=False)` returns as soon as the state is handed to a writer thread; the state
    must already be off the GPU and not change afterwards (the trainer hands over fresh CPU copies). A
    later save, `wait()` or `close()` waits for it.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, group: str | None = None,
                 trust_root: str | os.PathLike | None = None) -> None:
        if keep < 1:
            raise ValueError("keep must be ≥ 1")
        self.directory = Path(directory)
        self.keep = keep
        self.group = group
        self.trust_root = Path(trust_root) if trust_root else self.directory
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_save_seconds: float | None = None
        # damaged checkpoints the last load_latest() moved aside, one line each
        self.moved_aside: list[str] = []

    # ------------------------------------------------------------------------------------ saving
    def save(self, state: Mapping[str, Any], step: int, meta: Mapping[str, Any] | None = None,
             blocking: bool = True) -> Path:
        self.wait()
        final = self.directory / f"step_{step:08d}"
        if blocking:
            self._write(state, step, dict(meta or {}))
        else:
            self._thread = threading.Thread(target=self._write_in_thread,
                                            args=(state, step, dict(meta or {})),
                                            name=f"checkpoint-step-{step}", daemon=False)
            self._thread.start()
        return final

    def wait(self) -> None:
        """Block until a pending asynchronous save is durable; re-raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    close = wait

    def _write_in_thread(self, state: Mapping[str, Any], step: int, meta: dict[str, Any]) -> None:
        try:
            self._write(state, step, meta)
        except BaseException as err:  # surfaced by wait() in the training thread
            self._error = err

    def _write(self, state: Mapping[str, Any], step: int, meta: dict[str, Any]) -> None:
        import torch

        start = time.monotonic()
        final = self.directory / f"step_{step:08d}"
        tmp = self.directory / f"step_{step:08d}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            # inside: a read-only folder is a CheckpointError too
            make_private_dir(self.directory, self.group)
            make_private_dir(tmp, self.group)
            with open(tmp / "state.pt", "wb") as f:
                hashed = _HashingWriter(f)
                torch.save(dict(state), hashed)
                f.flush()
                os.fsync(f.fileno())
            files = {"state.pt": {"bytes": hashed.bytes, "sha256": hashed.sha256.hexdigest()}}
            meta = {**meta, "format": 1, "step": step, "saved_at": time.time(), "files": files}
            with open(tmp / "meta.json", "w") as f:
                json.dump(meta, f, indent=1, default=str)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            if final.exists():  # a re-save of the same step (e.g. after a resume): replace it whole
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.directory)
            self._point_latest(final.name)
        except (OSError, RuntimeError) as err:  # torch's zip writer wraps ENOSPC in a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            failed = _os_error(err)
            fix = LASTING_FIXES.get(failed.errno) if failed else None
            then = self._kept_and_next("previous", fix)
            raise CheckpointError(f"saving checkpoint step {step} to {self.directory} failed "
                                  f"({failed.strerror if failed else first_line(err)}); {then}",
                                  lasting=fix is not None) from None
        self._prune()
        self.last_save_seconds = time.monotonic() - start

    def _kept_and_next(self, which: str, fix: str | None) -> str:
        """'the <which> checkpoint (step N) is intact; ' and what follows: `fix` then a new submission, or
        (no fix: a failure that may not repeat) a restart."""
        kept = self.latest_step()
        resumes = f"resumes from step {kept}" if kept is not None else "starts from step 0"
        return ((f"the {which} checkpoint (step {kept}) is intact; " if kept is not None
                 else "no checkpoint exists yet; ")
                + (f"{fix}, then submit the run again: it {resumes}" if fix else f"a restart {resumes}"))

    def lasting_failure(self, err: BaseException) -> str | None:
        """One line for a failure no restart mends, else None: the operating system refused a file of the job
        folder these checkpoints are in (a full disk or quota, a read-only filesystem, permissions), storage
        every node shares, so any node that retried would meet it: the file, the checkpoint kept, the fix
        (`LASTING_FIXES`). A node's own disk is not this (`on_a_nodes_disk`)."""
        failed, in_job_folder = self._refused(err)
        if failed is None or not in_job_folder:
            return None
        then = self._kept_and_next("last", LASTING_FIXES[failed.errno])
        return f"{type(failed).__name__}: {failed.strerror}: {failed.filename}; {then}"

    def on_a_nodes_disk(self, err: BaseException) -> bool:
        """Whether `err` is a disk full or read-only outside the job folder (a node's /tmp, a local cache; an
        error naming no file too: every write of the job folder names its file): a fault of that node, which
        a restart without it may mend."""
        failed, in_job_folder = self._refused(err)
        return failed is not None and not in_job_folder and failed.errno in (errno.ENOSPC, errno.EROFS)

    def _refused(self, err: BaseException) -> tuple[OSError | None, bool | None]:
        """The operating system's refusal behind `err` that a retry on the same storage meets again
        (`LASTING_FIXES`), and whether the file it names is in the job folder (None: it names none)."""
        failed = _os_error(err)
        if failed is None or failed.errno not in LASTING_FIXES:
            return None, None
        if not failed.filename:
            return failed, None
        job_dir = os.path.abspath(self.directory.parent.parent)
        return failed, Path(os.path.abspath(failed.filename)).is_relative_to(job_dir)

    def no_room(self) -> str | None:
        """For a job that failed without a recorded cause: a line as `lasting_failure`'s where the filesystem
        of these checkpoints is read-only or full now (nothing could record the cause), else None."""
        try:
            fs = os.statvfs(self.directory if self.directory.exists() else self.directory.parent)
        except OSError:
            return None
        if fs.f_flag & os.ST_RDONLY:
            code = errno.EROFS
        elif fs.f_bavail * fs.f_frsize < NO_ROOM_BYTES:
            code = errno.ENOSPC
        else:
            return None
        return (f"OSError: {os.strerror(code)}: {self.directory.parent} (now; the job recorded no cause); "
                f"{self._kept_and_next('last', LASTING_FIXES[code])}")

    def _point_latest(self, name: str) -> None:
        write_text_atomic(self.directory / "latest", name + "\n", 0o600 if not self.group else 0o640)

    def _prune(self) -> None:
        steps = self.steps()
        latest = self.latest_step()
        for step in steps[: max(0, len(steps) - self.keep)]:
            if step != latest:
                shutil.rmtree(self.directory / f"step_{step:08d}", ignore_errors=True)
        for stale in self.directory.glob("step_*.tmp-*"):
            if stale.is_dir() and time.time() - stale.stat().st_mtime > 3600:  # left by a killed writer
                shutil.rmtree(stale, ignore_errors=True)

    # ----------------------------------------------------------------------------------- loading
    def steps(self) -> list[int]:
        """Steps of complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found
                      if m and (self.directory / m.group(0) / "meta.json").is_file())

    def latest_step(self) -> int | None:
        pointer = self.directory / "latest"
        try:
            m = _STEP_DIR.match(pointer.read_text().strip())
        except (FileNotFoundError, NotADirectoryError):
            m = None
        if m and (self.directory / m.group(0) / "meta.json").is_file():
            return int(m.group(1))
        steps = self.steps()  # pointer missing or stale: the newest complete folder is the truth
        return steps[-1] if steps else None

    def read_meta(self, step: int | None = None) -> dict[str, Any] | None:
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        return json.loads((self.directory / f"step_{step:08d}" / "meta.json").read_text())

    def load_latest(self) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """(step, state, meta) of the newest checkpoint that loads, or None when there is none.

        A newest checkpoint that cannot be read (cut short, overwritten) is moved aside to
        `step_N.damaged-<time>` — never deleted — and `latest` is pointed at the next older one, which is
        loaded instead: a requeued job resumes by itself. Each move is one line in `self.moved_aside`
        for the caller to log. A checkpoint refused for safety (another user's file) is not skipped.
        """
        self.moved_aside = []
        while (step := self.latest_step()) is not None:
            try:
                return self.load(step)
            except CheckpointError as err:
                self._move_aside(step, err)
        return None

    def _move_aside(self, step: int, err: CheckpointError) -> None:
        folder = self.directory / f"step_{step:08d}"
        target = folder.with_name(f"{folder.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        with contextlib.suppress(FileNotFoundError):  # another rank moved it a moment ago
            os.rename(folder, target)
        steps = self.steps()
        if steps:
            self._point_latest(f"step_{steps[-1]:08d}")
        else:
            (self.directory / "latest").unlink(missing_ok=True)
        kept = f"resuming from step {steps[-1]}" if steps else "no older checkpoint: starting from step 0"
        self.moved_aside.append(f"checkpoint step {step} is damaged ({err.cause}); moved it to {target.name} "
                                f"(kept for inspection) and {kept}")

    def load(self, step: int) -> tuple[int, dict[str, Any], dict[str, Any]]:
        import torch

        folder = self.directory / f"step_{step:08d}"
        for name in ("state.pt", "meta.json"):
            check_safe_to_load(folder / name, self.trust_root)
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"cannot load checkpoint {folder}: meta.json is damaged; "
                                  "delete that folder to "
                                  "resume from an older one", cause="meta.json is damaged") from None
        # Checkpoints from before checksums were recorded (earlier 0.1.0 code) have none: they load as before.
        for name, expected in (meta.get("files") or {}).items():
            if (problem := _mismatch(folder / name, expected)) is not None:
                raise CheckpointError(f"cannot load checkpoint {folder}: {problem}; delete that folder to "
                                      "resume from an older one (it was not loaded)", cause=problem)
        try:
            state = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
        except Exception as err:
            # our own words: torch's advice (weights_only=False) would run the file's code
            cause = _load_failure(err)
            raise CheckpointError(f"cannot load checkpoint {folder}: {cause}; "
                                  "delete that folder to resume from an "
                                  "older one (it was not loaded)", cause=cause) from None
        return step, state, meta


class _HashingWriter:
    """A file that hashes what torch.save writes through it (no second read of a ~135 MB file)."""

    def __init__(self, file: Any) -> None:
        self.file, self.sha256, self.bytes = file, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.bytes += view.nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _mismatch(path: Path, expected: Mapping[str, Any]) -> str | None:
    """Why `path` is not the file its checksum describes (None when it is)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path.name} is missing"
    if size != expected.get("bytes"):
        return (f"{path.name} has {size} bytes, {expected.get('bytes')} were written "
                "(cut short or overwritten)")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != expected.get("sha256"):
        return f"{path.name} does not match its checksum (overwritten since it was saved)"
    return None


def nonfinite_tensors(tensors: Mapping[str, Any]) -> list[str]:
    """Names of the tensors in `tensors` (nested dicts of tensors) that hold a NaN or an infinity."""
    import torch

    found = []
    for name, value in tensors.items():
        if isinstance(value, Mapping):
            found += [f"{name}.{inner}" for inner in nonfinite_tensors(value)]
        elif torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            found.append(name)
    return found


def _load_failure(err: BaseException) -> str:
    """Why torch.load(weights_only=True) failed, in one line and never suggesting weights_only=False."""
    text = str(err)
    found = re.search(r"GLOBAL (\S+)", text)
    if found:  # a pickled Python object: rebuilding it could execute code, so it is refused
        return (f"state.pt holds a Python object ({found.group(1)}), not only tensors and plain values, "
                "and such objects are never unpickled (they could run code)")
    # torch's reason, without its headline about weights_only (it would point at the unsafe retry)
    unpickler = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    reason = unpickler.group(1).strip() if unpickler else first_line(err).split(". ")[0]
    return ("state.pt is damaged or not a torch checkpoint: cut short, overwritten, or not written by this "
            f"library ({reason})")


def _os_error(err: BaseException) -> OSError | None:
    """The operating system's error behind `err` (torch's zip writer wraps it in a RuntimeError), if any."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause
        cause = cause.__cause__ or cause.__context__
    return None
