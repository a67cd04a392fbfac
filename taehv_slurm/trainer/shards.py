"""The shard files of a prepared folder, and `verify`, which checks them against the window list.

    shards/shard_000012.safetensors
        frames   uint8 N×T×3×H×W   the whole window, as the student sees it
        latents  bf16  N×L×C×h×w   the teacher's latents of frames[:, :4L−3] (L = T/4, scaled)
        metadata (strings): format, shard, windows (JSON ids in storage order), rows (JSON
                 [[video, window_start]] of those ids: the shard's own index), failed (JSON
                 [[id, reason]]), frames/height/width, seconds, written_at, host, rank, job_id

Shard s holds windows [s·K, (s+1)·K) minus any that failed to decode (recorded in its metadata, never
silently replaced). A shard is written under a temporary name, fsynced and renamed, so its existence
means "finished". Everything here but `write_shard` reads headers only: no torch.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taehv_slurm.common.messages import first_line
from taehv_slurm.common.runfolder import fsync_dir
from taehv_slurm.trainer.manifest import FORMAT, INDEX_FILE, Manifest, write_csv
from taehv_slurm.trainer.shapes import SPATIAL_FACTOR, TIME_FACTOR

if TYPE_CHECKING:
    import torch

SHARD_DIR = "shards"
INDEX_COLUMNS = ("window", "video", "window_start", "shard", "offset")


def shard_path(out: str | os.PathLike, shard: int) -> Path:
    return Path(out) / SHARD_DIR / f"shard_{shard:06d}.safetensors"


def finished_shards(out: str | os.PathLike) -> set[int]:
    """Shards whose file exists (one directory listing, not one stat per shard)."""
    folder = Path(out) / SHARD_DIR
    if not folder.is_dir():
        return set()
    done = set()
    for name in os.listdir(folder):
        if name.startswith("shard_") and name.endswith(".safetensors"):
            try:
                done.add(int(name[len("shard_"):-len(".safetensors")]))
            except ValueError:
                continue
    return done


def read_shard_header(path: str | os.PathLike) -> tuple[dict[str, str], dict[str, Any]]:
    """(metadata, tensors: name → {dtype, shape, data_offsets}) from a safetensors header, without torch."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 100 * 2**20:
            raise ValueError(f"bad safetensors header length {size}")
        header = json.loads(f.read(size))
    return header.pop("__metadata__", {}) or {}, header


def write_shard(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                tag: str = "") -> None:
    """Write a safetensors file atomically: temporary name in the same folder, fsync, rename, fsync the
    folder."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{tag}{'-' if tag else ''}{uuid.uuid4().hex[:8]}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=dict(metadata))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, SafetensorError) and "I/O error" in str(err):  # not an OSError
            raise OSError(f"cannot write {path}: {first_line(err)}; make room there (or pass another --out) "
                          "and run the same command again: the finished shards are kept") from None
        raise
    fsync_dir(path.parent)


def shard_metadata(shard: int, stored: Sequence[int], rows: Sequence[tuple[str, int]],
                   failed: Sequence[Sequence[Any]],
                   spec: Sequence[int], seconds: float, **extra: Any) -> dict[str, str]:
    """The metadata strings of a shard file (what `verify` reads from its header). `rows` are the
    (video, window_start) of the stored windows: each shard is its own index, checkable against the
    manifest."""
    frames, height, width = spec
    return {"format": FORMAT, "shard": str(shard), "windows": json.dumps([int(w) for w in stored]),
            "rows": json.dumps([[str(v), int(s)] for v, s in rows]),
            "failed": json.dumps([list(f) for f in failed]), "frames": str(frames), "height": str(height),
            "width": str(width), "seconds": f"{seconds:.4f}", "written_at": f"{time.time():.3f}",
            "host": socket.gethostname(), **{k: str(v) for k, v in extra.items()}}


def remove_stale_temporaries(out: Path, job_id: str, max_age_s: float = 3600.0) -> int:
    """Temporary shard files left by a killed writer: this job's (its earlier runs are over) or old ones."""
    folder = out / SHARD_DIR
    removed = 0
    for tmp in folder.glob(".shard_*.tmp-*") if folder.is_dir() else ():
        try:
            if f".tmp-{job_id}-" in tmp.name or time.time() - tmp.stat().st_mtime > max_age_s:
                tmp.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed


@dataclass
class VerifyReport:
    """The result of checking a prepared folder against its expected window list."""

    out: str
    spec: tuple[int, int, int]
    teacher: str
    videos: int
    skipped_files: dict[str, int]
    windows_expected: int
    windows_stored: int = 0
    decode_errors: list[tuple[int, str]] = field(default_factory=list)
    missing_windows: list[int] = field(default_factory=list)
    duplicate_windows: list[int] = field(default_factory=list)
    shards_expected: int = 0
    shards_done: int = 0
    missing_shards: list[int] = field(default_factory=list)
    bad_shards: list[str] = field(default_factory=list)  # "shard N: problem"
    work_seconds: float = 0.0  # sum over shards of decode + encode + write
    wall_seconds: float = 0.0  # first shard started → last shard written
    index_seconds: float = 0.0
    index: str | None = None  # index.csv, written when the folder is complete

    @property
    def ok(self) -> bool:
        return not (self.missing_windows or self.duplicate_windows or self.missing_shards or self.bad_shards)

    def problems(self) -> list[str]:
        out = []
        if self.missing_shards:
            out.append(f"{len(self.missing_shards)} shard(s) missing: {_ids(self.missing_shards)}")
        out += self.bad_shards
        if self.missing_windows:
            out.append(f"{len(self.missing_windows)} window(s) missing: {_ids(self.missing_windows)}")
        if self.duplicate_windows:
            out.append(f"{len(self.duplicate_windows)} window(s) stored twice: "
                       f"{_ids(self.duplicate_windows)}")
        return out

    def table(self) -> str:
        frames, height, width = self.spec
        skipped = ", ".join(f"{reason} {n}" for reason, n in sorted(self.skipped_files.items())) or "none"
        skipped_windows = f"decode_error {len(self.decode_errors)} (windows)" if self.decode_errors else ""
        rows = [
            ("videos", f"{self.videos} indexed, {sum(self.skipped_files.values())} file(s) skipped"),
            ("windows", f"{self.windows_expected} expected, {self.windows_stored} stored, "
                        f"{len(self.decode_errors)} decode errors, {len(self.missing_windows)} missing, "
                        f"{len(self.duplicate_windows)} duplicated"),
            ("shards", f"{self.shards_done} of {self.shards_expected} written, "
                       f"{len(self.missing_shards)} missing, {len(self.bad_shards)} bad"),
            ("skipped files", skipped + (f"; {skipped_windows}" if skipped_windows else "")),
            ("seconds", f"{self.work_seconds:.1f} shard work (sum over ranks), {self.wall_seconds:.1f} wall, "
                        f"{self.index_seconds:.1f} indexing"),
            ("index", self.index or "not written: " + "; ".join(self.problems())),
        ]
        head = (f"prepared {frames}×{height}×{width} clips (frames×height×width) in {self.out}, "
                f"teacher {self.teacher}: "
                + ("OK" if self.ok else "INCOMPLETE"))
        width_ = max(len(k) for k, _ in rows)
        return "\n".join([head] + [f"  {k:<{width_}}  {v}" for k, v in rows])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify(out: str | os.PathLike, write_index: bool = True) -> VerifyReport:
    """Check every shard against the expected windows; when complete, write index.csv (atomically).

    Reads only prepare.json, the window list and each shard's header: no torch, no tensor data.
    """
    out = Path(out)
    manifest = Manifest.read(out)
    s = manifest.settings
    report = VerifyReport(str(out), manifest.spec, f"{s['teacher_kind']} {s['teacher_path']}",
                          len(manifest.videos), manifest.skipped, len(manifest.windows),
                          shards_expected=manifest.num_shards, index_seconds=manifest.index_seconds)
    seen: dict[int, int] = {}
    failed: set[int] = set()
    rows: list[tuple[int, str, int, int, int]] = []
    starts, ends = [], []
    done = finished_shards(out)
    report.bad_shards += [f"shard {n}: not in the manifest ({manifest.num_shards} shards)"
                          for n in sorted(done) if n >= manifest.num_shards]
    for shard in range(manifest.num_shards):
        if shard not in done:
            report.missing_shards.append(shard)
            continue
        try:
            meta, tensors = read_shard_header(shard_path(out, shard))
            ids = [int(i) for i in json.loads(meta["windows"])]
            errors = [(int(i), str(reason)) for i, reason in json.loads(meta.get("failed", "[]"))]
            problem = _shard_problem(meta, tensors, ids, errors, manifest, shard)
        except (OSError, ValueError, KeyError, TypeError) as err:
            problem = f"unreadable ({type(err).__name__}: {err})"
        if problem:
            report.bad_shards.append(f"shard {shard}: {problem}")
            continue
        report.shards_done += 1
        for offset, window in enumerate(ids):
            seen[window] = seen.get(window, 0) + 1
            video, start = manifest.windows[window]
            rows.append((window, video, start, shard, offset))
        for window, reason in errors:
            failed.add(window)
            report.decode_errors.append((window, reason))
        seconds = float(meta.get("seconds", 0.0))
        written = float(meta.get("written_at", 0.0))
        report.work_seconds += seconds
        if written:
            starts.append(written - seconds)
            ends.append(written)
    report.windows_stored = len(rows)
    report.duplicate_windows = sorted(w for w, n in seen.items() if n > 1)
    present = set(seen) | failed
    # incl. those of missing shards
    report.missing_windows = [w for w in range(len(manifest.windows)) if w not in present]
    report.wall_seconds = (max(ends) - min(starts)) if ends else 0.0
    index = out / INDEX_FILE
    if write_index and report.ok:
        rows.sort()
        write_csv(index, INDEX_COLUMNS, rows)
        report.index = f"{index} ({len(rows)} rows)"
    elif write_index and index.exists():
        index.unlink()  # it would name shards or windows that are not there any more
    return report


def _shard_problem(meta: Mapping[str, str], tensors: Mapping[str, Any], ids: Sequence[int],
                   errors: Sequence[tuple[int, str]], manifest: Manifest, shard: int) -> str | None:
    frames, height, width = manifest.spec
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')!r}, expected {FORMAT!r}"
    planned = manifest.shard_windows(shard)
    strays = [w for w in [*ids, *(w for w, _ in errors)] if w not in planned]
    if strays:
        return f"holds window(s) {_ids(strays)} that belong to other shards"
    rows = [tuple(r) for r in json.loads(meta.get("rows", "[]"))]
    if rows != [manifest.windows[w] for w in ids]:
        return ("its (video, window_start) rows differ from this folder's window list: "
                "it comes from another preparation")
    f, z = tensors.get("frames"), tensors.get("latents")
    if f is None or z is None:
        return "lacks the frames or latents tensor"
    n = len(ids)
    if f["dtype"] != "U8" or f["shape"] != [n, frames, 3, height, width]:
        return f"frames are {f['dtype']} {f['shape']}, expected U8 {[n, frames, 3, height, width]}"
    want = [n, frames // TIME_FACTOR, None, height // SPATIAL_FACTOR, width // SPATIAL_FACTOR]
    if (z["dtype"] != "BF16" or len(z["shape"]) != 5
            or any(w is not None and w != g for w, g in zip(want, z["shape"]))):
        return (f"latents are {z['dtype']} {z['shape']}, "
                f"expected BF16 [{n}, {want[1]}, C, {want[3]}, {want[4]}]")
    return None


def _ids(ids: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, list(ids)[:limit]))
    return shown + (f", … ({len(ids)} in all)" if len(ids) > limit else "")
