"""Prepare training data once: decode every video window, encode it with the teacher, store both in shards.

The teacher's encode costs ~7× the student's training step per clip (8.3 vs 55 clips/s per GPU,
docs/benchmarks.md "Data"), so it runs once per window, ahead of training, on every GPU of a job; the
trainer then reads frames and latents together (`trainer.prepared.PreparedClips`, `data.source: prepared`).

Layout of a prepared folder:

    prepare.json      what is prepared: data root, clip spec, stride, shard size, teacher; counts
    videos.csv        per video: path (relative to the data root), frame count, rate, time base, start pts
    windows.csv       the expected windows (id = row): video, window_start, shard — what verify checks against
    shards/shard_000012.safetensors
                      frames   uint8 N×T×3×H×W   the whole window, as the student sees it
                      latents  bf16  N×L×C×h×w   the teacher's latents of frames[:, :4L−3] (L = T/4, scaled)
                      metadata (strings): format, shard, windows (JSON ids in storage order), rows (JSON
                               [[video, window_start]] of those ids: the shard's own index), failed (JSON
                               [[id, reason]]), frames/height/width, seconds, written_at, host, rank, job_id
    index.csv         written by `verify` once every shard is there: window, video, window_start, shard, offset

Windows come from `VideoFolderClips` (the training windowing); shard s holds windows
[s·K, (s+1)·K) minus any that failed to decode (recorded in its metadata, never silently replaced).
A shard is written under a temporary name, fsynced and renamed, so its existence means "finished":
a requeued or resubmitted job skips it. `PrepareTask` is the callable every rank runs (wrapped in
`RequeueableTask` by `taehv_slurm.handle.submit`): the ranks agree on the unfinished shards, take
every world_size-th one, and check for signals between shards (one agreed flag per round).

This module imports torch only inside the functions that need it: the CLI's --help, --dry-run and
--verify stay light.
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taehv_slurm.checkpoint import fsync_dir, write_text_atomic
from taehv_slurm.config import TEACHER_KINDS, VIDEO_EXTENSIONS, ConfigError, RuntimeSettings
from taehv_slurm.messages import one_line, rank_logger

from .shapes import SPATIAL_FACTOR, TIME_FACTOR

if TYPE_CHECKING:
    import torch

    from taehv_slurm.config import ClusterConfig
    from taehv_slurm.handle import JobHandle
    from taehv_slurm.requeue import RunContext

    from .data import VideoFolderClips

FORMAT = "taehv-prepared/1"
MANIFEST_FILE, VIDEOS_FILE, WINDOWS_FILE, INDEX_FILE = "prepare.json", "videos.csv", "windows.csv", "index.csv"
SHARD_DIR = "shards"
INDEX_COLUMNS = ("window", "video", "window_start", "shard", "offset")
# Settings that define what a folder holds: a resubmission must match them to resume it.
IDENTITY_KEYS = ("data", "frames", "height", "width", "stride", "shard_size", "teacher_kind", "teacher_path",
                 "scaling_factor", "seed")

log = logging.getLogger("taehv.prepare")


class PrepareError(ConfigError):
    """Bad input for a preparation (data, output folder, teacher); the message is one line naming the fix."""


# ------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class PrepareSettings:
    """What to prepare. Every field but the data root has the training defaults (12 × 480 × 720)."""

    data: str
    frames: int = 12
    height: int = 480
    width: int = 720
    stride: int | None = None  # frames between window starts; None: non-overlapping (= frames), as in training
    shard_size: int = 32  # windows per shard: 32 × 12 × 480 × 720 × 3 B ≈ 400 MB files
    teacher_kind: str = "hunyuanvideo"
    teacher_path: str = ""
    scaling_factor: float | None = None  # None: the VAE config's value
    seed: int = 0  # seed of a built-in random teacher (random:tiny)

    def validate(self) -> PrepareSettings:
        """Check without importing torch; returns a copy with absolute paths and the stride filled in."""
        if self.frames < TIME_FACTOR or self.frames % TIME_FACTOR:
            raise PrepareError(f"--frames must be a multiple of {TIME_FACTOR} (TAEHV encodes 4 frames per latent), got {self.frames}")
        if min(self.height, self.width) <= 0 or self.height % SPATIAL_FACTOR or self.width % SPATIAL_FACTOR:
            raise PrepareError(f"--height and --width must be positive multiples of {SPATIAL_FACTOR}, got {self.height}×{self.width}")
        if self.shard_size < 1:
            raise PrepareError(f"--shard-size must be ≥ 1, got {self.shard_size}")
        stride = self.frames if self.stride is None else self.stride
        if stride < 1:
            raise PrepareError(f"--stride must be ≥ 1, got {stride}")
        data = Path(self.data).expanduser()
        if not data.is_dir():
            raise PrepareError(f"data folder {self.data} does not exist or is not a folder; pass --data a folder of "
                               f"{'/'.join(VIDEO_EXTENSIONS)} files")
        if not any(count_videos(data, limit=1)):
            raise PrepareError(f"data folder {self.data} holds no {'/'.join(VIDEO_EXTENSIONS)} files; "
                               "add videos there or pass another --data")
        if self.teacher_kind not in TEACHER_KINDS:
            raise PrepareError(f"--teacher-kind {self.teacher_kind!r} is not one of {', '.join(TEACHER_KINDS)}")
        teacher_path = self.teacher_path
        if not teacher_path:
            raise PrepareError("--teacher-path is missing: pass a local diffusers VAE folder (config.json + weights)")
        if teacher_path.startswith("random:"):
            if teacher_path != "random:tiny" or self.teacher_kind != "hunyuanvideo":
                raise PrepareError(f"--teacher-path {teacher_path}: the only built-in teacher is random:tiny "
                                   "(kind hunyuanvideo); pass a local diffusers VAE folder otherwise")
        else:
            folder = Path(teacher_path).expanduser()
            if not (folder / "config.json").is_file():
                raise PrepareError(f"--teacher-path {teacher_path}: no diffusers VAE there (no config.json); point it at "
                                   "a local folder saved with save_pretrained (e.g. the 'vae' folder of the model)")
            teacher_path = str(folder.resolve())
        return PrepareSettings(str(data.resolve()), self.frames, self.height, self.width, stride, self.shard_size,
                               self.teacher_kind, teacher_path, self.scaling_factor, self.seed)

    def identity(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in IDENTITY_KEYS}


def count_videos(root: Path, limit: int | None = None) -> Iterator[Path]:
    """Video files under root (recursive), at most `limit` of them: no decoding, no torch."""
    found = 0
    for path in root.rglob("*"):
        if path.suffix.lower() in VIDEO_EXTENSIONS and path.is_file():
            yield path
            found += 1
            if limit is not None and found >= limit:
                return


# ------------------------------------------------------------------------------------------ manifest


@dataclass
class Manifest:
    """What a prepared folder holds or will hold: prepare.json + videos.csv + windows.csv."""

    settings: dict[str, Any]
    videos: dict[str, dict[str, Any]]  # relative path → num_frames, rate, time_base, start_pts, counted_by
    windows: list[tuple[str, int]]  # (relative path, first frame); a window's id is its position
    skipped: dict[str, int] = field(default_factory=dict)  # files skipped when indexing, by reason
    created: float = 0.0
    index_seconds: float = 0.0

    @property
    def shard_size(self) -> int:
        return int(self.settings["shard_size"])

    @property
    def num_shards(self) -> int:
        return math.ceil(len(self.windows) / self.shard_size)

    @property
    def spec(self) -> tuple[int, int, int]:
        return int(self.settings["frames"]), int(self.settings["height"]), int(self.settings["width"])

    def shard_windows(self, shard: int) -> range:
        return range(shard * self.shard_size, min(len(self.windows), (shard + 1) * self.shard_size))

    def describe(self) -> str:
        frames, height, width = self.spec
        s = self.settings
        return (f"{frames}×{height}×{width} windows (stride {s['stride']}) of {len(self.videos)} videos in {s['data']}; "
                f"teacher {s['teacher_kind']} {s['teacher_path']}; {len(self.windows)} windows in "
                f"{self.num_shards} shards of {self.shard_size}")

    def write(self, out: Path) -> None:
        """prepare.json last: its presence means the window list beside it is complete."""
        rows = [(rel, info["num_frames"], info["rate"], info["time_base"], info["start_pts"], info["counted_by"])
                for rel, info in self.videos.items()]
        _write_csv(out / VIDEOS_FILE, ("video", "num_frames", "rate", "time_base", "start_pts", "counted_by"), rows)
        _write_csv(out / WINDOWS_FILE, ("window", "video", "window_start", "shard"),
                   ((i, rel, start, i // self.shard_size) for i, (rel, start) in enumerate(self.windows)))
        info = {"format": FORMAT, **self.settings, "videos": len(self.videos), "windows": len(self.windows),
                "shards": self.num_shards, "skipped": self.skipped, "created": self.created,
                "index_seconds": round(self.index_seconds, 3),
                "teacher_frames": self.spec[0] - (TIME_FACTOR - 1), "latent_frames": self.spec[0] // TIME_FACTOR}
        write_text_atomic(out / MANIFEST_FILE, json.dumps(info, indent=1) + "\n")

    @classmethod
    def read(cls, out: str | os.PathLike) -> Manifest:
        out = Path(out)
        info = read_manifest_info(out)
        with open(out / VIDEOS_FILE, newline="") as f:
            videos = {row["video"]: {"num_frames": int(row["num_frames"]), "rate": row["rate"], "time_base": row["time_base"],
                                     "start_pts": int(row["start_pts"]), "counted_by": row["counted_by"]}
                      for row in csv.DictReader(f)}
        with open(out / WINDOWS_FILE, newline="") as f:
            windows = [(row["video"], int(row["window_start"])) for row in csv.DictReader(f)]
        if len(windows) != info["windows"]:
            raise PrepareError(f"{out / WINDOWS_FILE} lists {len(windows)} windows but {MANIFEST_FILE} says {info['windows']}; "
                               "the folder was changed by hand: prepare into a new --out")
        return cls({k: info[k] for k in IDENTITY_KEYS}, videos, windows, dict(info.get("skipped", {})),
                   float(info.get("created", 0.0)), float(info.get("index_seconds", 0.0)))


def read_manifest_info(out: str | os.PathLike) -> dict[str, Any]:
    """prepare.json of a prepared folder, or a one-line PrepareError saying what the folder is not."""
    out = Path(out)
    if not out.is_dir():
        raise PrepareError(f"prepared data folder {out} does not exist; prepare it with "
                           f"`python -m jobs.prepare --data VIDEOS --out {out} --teacher-path VAE`")
    path = out / MANIFEST_FILE
    if not path.is_file():
        raise PrepareError(f"{out} is not a prepared data folder (no {MANIFEST_FILE}); prepare it with "
                           f"`python -m jobs.prepare --data VIDEOS --out {out} --teacher-path VAE`")
    try:
        info = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PrepareError(f"{path} is unreadable ({err}); prepare into a new --out") from None
    if info.get("format") != FORMAT:
        raise PrepareError(f"{path} has format {info.get('format')!r}, this code reads {FORMAT!r}; prepare again into a new --out")
    return info


def index_windows(settings: PrepareSettings) -> Manifest:
    """Index the videos with the training windowing (VideoFolderClips) into a Manifest. Imports torch."""
    from .data import ClipSpec, VideoFolderClips

    start = time.perf_counter()
    root = Path(settings.data)
    try:
        clips = VideoFolderClips(root, ClipSpec(settings.frames, settings.height, settings.width), stride=settings.stride)
    except ValueError as err:  # no files / no window: already one line naming the folder and the fix
        raise PrepareError(str(err)) from None
    videos = {_relative(key, root): {"num_frames": info.num_frames, "rate": str(info.rate), "time_base": str(info.time_base),
                                     "start_pts": info.start_pts, "counted_by": info.counted_by}
              for key, info in clips.videos.items()}
    windows = [(_relative(key, root), start_frame) for key, start_frame in clips.windows]
    return Manifest(settings.identity(), videos, windows, dict(clips.skipped), time.time(), time.perf_counter() - start)


def _relative(key: str, root: Path) -> str:
    return Path(key).relative_to(root).as_posix()


def open_clips(manifest: Manifest) -> VideoFolderClips:
    """The manifest's windows as a VideoFolderClips, rebuilt from the saved index (no re-probing of files)."""
    from .data import ClipSpec, VideoFolderClips, VideoInfo

    root = Path(manifest.settings["data"])
    videos = {str(root / rel): VideoInfo(v["num_frames"], Fraction(v["rate"]), Fraction(v["time_base"]), v["start_pts"],
                                         v["counted_by"]) for rel, v in manifest.videos.items()}
    windows = [(str(root / rel), start) for rel, start in manifest.windows]
    return VideoFolderClips.from_index(root, ClipSpec(*manifest.spec), videos, windows, stride=int(manifest.settings["stride"]))


# -------------------------------------------------------------------------------------------- shards


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


def write_shard(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], tag: str = "") -> None:
    """Write a safetensors file atomically: temporary name in the same folder, fsync, rename, fsync the folder."""
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def shard_metadata(shard: int, stored: Sequence[int], rows: Sequence[tuple[str, int]], failed: Sequence[Sequence[Any]],
                   spec: Sequence[int], seconds: float, **extra: Any) -> dict[str, str]:
    """The metadata strings of a shard file (what `verify` reads from its header). `rows` are the
    (video, window_start) of the stored windows: each shard is its own index, checkable against the manifest."""
    frames, height, width = spec
    return {"format": FORMAT, "shard": str(shard), "windows": json.dumps([int(w) for w in stored]),
            "rows": json.dumps([[str(v), int(s)] for v, s in rows]),
            "failed": json.dumps([list(f) for f in failed]), "frames": str(frames), "height": str(height),
            "width": str(width), "seconds": f"{seconds:.4f}", "written_at": f"{time.time():.3f}",
            "host": socket.gethostname(), **{k: str(v) for k, v in extra.items()}}


def should_abandon(done: int, total: int, elapsed_s: float, since_signal_s: float, budget_s: float) -> bool:
    """After a signal, with `done` of `total` windows of a shard in `elapsed_s`: abandon it unless
    finishing (with 50 % margin) fits in what is left of `budget_s`. Nothing done yet: abandon."""
    if done <= 0:
        return True
    return elapsed_s / done * (total - done) * 1.5 > budget_s - since_signal_s


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


# -------------------------------------------------------------------------------------------- verify


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
            out.append(f"{len(self.duplicate_windows)} window(s) stored twice: {_ids(self.duplicate_windows)}")
        return out

    def table(self) -> str:
        frames, height, width = self.spec
        skipped = ", ".join(f"{reason} {n}" for reason, n in sorted(self.skipped_files.items())) or "none"
        skipped_windows = f"decode_error {len(self.decode_errors)} (windows)" if self.decode_errors else ""
        rows = [
            ("videos", f"{self.videos} indexed, {sum(self.skipped_files.values())} file(s) skipped"),
            ("windows", f"{self.windows_expected} expected, {self.windows_stored} stored, {len(self.decode_errors)} "
                        f"decode errors, {len(self.missing_windows)} missing, {len(self.duplicate_windows)} duplicated"),
            ("shards", f"{self.shards_done} of {self.shards_expected} written, {len(self.missing_shards)} missing, "
                       f"{len(self.bad_shards)} bad"),
            ("skipped files", skipped + (f"; {skipped_windows}" if skipped_windows else "")),
            ("seconds", f"{self.work_seconds:.1f} shard work (sum over ranks), {self.wall_seconds:.1f} wall, "
                        f"{self.index_seconds:.1f} indexing"),
            ("index", self.index or "not written: " + "; ".join(self.problems())),
        ]
        head = (f"prepared {frames}×{height}×{width} clips (frames×height×width) in {self.out}, teacher {self.teacher}: "
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
    report = VerifyReport(str(out), manifest.spec, f"{s['teacher_kind']} {s['teacher_path']}", len(manifest.videos), manifest.skipped,
                          len(manifest.windows), shards_expected=manifest.num_shards, index_seconds=manifest.index_seconds)
    seen: dict[int, int] = {}
    failed: set[int] = set()
    rows: list[tuple[int, str, int, int, int]] = []
    starts, ends = [], []
    done = finished_shards(out)
    report.bad_shards += [f"shard {n}: not in the manifest ({manifest.num_shards} shards)" for n in sorted(done) if n >= manifest.num_shards]
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
    report.missing_windows = [w for w in range(len(manifest.windows)) if w not in present]  # incl. those of missing shards
    report.wall_seconds = (max(ends) - min(starts)) if ends else 0.0
    index = out / INDEX_FILE
    if write_index and report.ok:
        rows.sort()
        _write_csv(index, INDEX_COLUMNS, rows)
        report.index = f"{index} ({len(rows)} rows)"
    elif write_index and index.exists():
        index.unlink()  # it would name shards or windows that are not there any more
    return report


def _shard_problem(meta: Mapping[str, str], tensors: Mapping[str, Any], ids: Sequence[int], errors: Sequence[tuple[int, str]],
                   manifest: Manifest, shard: int) -> str | None:
    frames, height, width = manifest.spec
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')!r}, expected {FORMAT!r}"
    planned = manifest.shard_windows(shard)
    strays = [w for w in [*ids, *(w for w, _ in errors)] if w not in planned]
    if strays:
        return f"holds window(s) {_ids(strays)} that belong to other shards"
    rows = [tuple(r) for r in json.loads(meta.get("rows", "[]"))]
    if rows != [manifest.windows[w] for w in ids]:
        return "its (video, window_start) rows differ from this folder's window list: it comes from another preparation"
    f, z = tensors.get("frames"), tensors.get("latents")
    if f is None or z is None:
        return "lacks the frames or latents tensor"
    n = len(ids)
    if f["dtype"] != "U8" or f["shape"] != [n, frames, 3, height, width]:
        return f"frames are {f['dtype']} {f['shape']}, expected U8 {[n, frames, 3, height, width]}"
    want = [n, frames // TIME_FACTOR, None, height // SPATIAL_FACTOR, width // SPATIAL_FACTOR]
    if z["dtype"] != "BF16" or len(z["shape"]) != 5 or any(w is not None and w != g for w, g in zip(want, z["shape"])):
        return f"latents are {z['dtype']} {z['shape']}, expected BF16 [{n}, {want[1]}, C, {want[3]}, {want[4]}]"
    return None


def _ids(ids: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, list(ids)[:limit]))
    return shown + (f", … ({len(ids)} in all)" if len(ids) > limit else "")


# ---------------------------------------------------------------------------------------- the worker


class PrepareTask:
    """The picklable callable every rank of a preparation job runs; call with no argument to run here.

    runtime: `ClusterConfig.runtime()` (device, threads, timeouts). batch: clips per teacher call.
    workers: decoding processes per rank (None: cpus_per_task − 1 on GPU, 0 on CPU). compile:
    torch.compile the teacher's encoder (CUDA only; batches are padded to one shape so it compiles once).
    finish_budget_s: after a signal, a shard in progress is finished if that is expected to take less
    than this many seconds, else abandoned (its temporary file removed; the next run redoes it).
    """

    def __init__(self, out: str | os.PathLike, runtime: RuntimeSettings | Mapping[str, Any] | None = None, batch: int = 4,
                 workers: int | None = None, compile: bool = False,
                 finish_budget_s: Mapping[str, float] | None = None) -> None:
        self.out = str(out)
        self.runtime = RuntimeSettings.of(runtime)
        self.batch = int(batch)
        self.workers = workers
        self.compile = bool(compile)
        self.finish_budget_s = dict(finish_budget_s or {"timeout": 50.0, "preempted": 10.0})

    def __call__(self, ctx: RunContext | None = None) -> dict[str, Any]:
        import torch

        from taehv_slurm.distenv import destroy_distributed, init_distributed
        from taehv_slurm.requeue import RunContext

        ctx = ctx or RunContext.standalone(Path(self.out) / "run")
        rank_logger(log.name, ctx.env.rank, every_rank_informs=True)
        choice = self.runtime.device
        use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", ctx.env.local_rank) if use_cuda else torch.device("cpu")
        torch.set_num_threads(self.runtime.torch_threads)
        # gloo even on GPUs: the ranks only agree on a few integers; the teacher needs no collectives.
        init_distributed(ctx.env, "gloo", timeout_s=self.runtime.collective_timeout_s or 3600,
                         rendezvous_timeout_s=self.runtime.rendezvous_timeout_s, use_cuda=use_cuda)
        try:
            return _Worker(self, ctx, device).run()
        finally:
            destroy_distributed()


class _WindowReader:
    """Map-style source for a DataLoader: window id → its frames, or why it could not be decoded."""

    def __init__(self, clips: VideoFolderClips) -> None:
        self.clips = clips

    def __len__(self) -> int:
        return len(self.clips.windows)

    def __getitem__(self, window: int) -> dict[str, Any]:
        try:
            return {"window": window, "frames": self.clips.read_window(window), "error": ""}
        except Exception as err:  # one bad window never stops a shard: it is recorded as failed
            return {"window": window, "frames": None, "error": one_line(err)[:300]}


class _Worker:
    def __init__(self, task: PrepareTask, ctx: RunContext, device: torch.device) -> None:
        self.task, self.ctx, self.device = task, ctx, device
        self.env = ctx.env
        self.out = Path(task.out)

    def run(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from .teacher import load_teacher

        ctx, env = self.ctx, self.env
        manifest = Manifest.read(self.out)
        remaining = self._agree_on_remaining(manifest)
        s = manifest.settings
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32  # bf16 convs are slow on CPUs
        # Loaded before ctx.started: a bad teacher fails the job once instead of requeueing it.
        teacher = load_teacher(s["teacher_kind"], s["teacher_path"], s["scaling_factor"], s["seed"]).to(self.device, dtype)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # one input shape throughout: the autotuned kernels pay off
            if self.task.compile:
                teacher.vae.encoder.compile(dynamic=False)
        self.teacher, self.latent_channels = teacher, int(teacher.vae.config.latent_channels)
        clips = open_clips(manifest)
        done_before = manifest.num_shards - len(remaining)
        ctx.started(done_before, shards=manifest.num_shards, remaining=len(remaining), device=str(self.device))
        mine = remaining[env.rank::env.world_size]
        rounds = math.ceil(len(remaining) / env.world_size)
        log.info("rank %d/%d: %d of %d shards left, %d for this rank (%s, batch %d, %s)", env.rank, env.world_size,
                 len(remaining), manifest.num_shards, len(mine), self.device, self.task.batch,
                 "compiled" if self.task.compile and self.device.type == "cuda" else "eager")
        stream = self._stream(clips, [w for shard in mine for w in manifest.shard_windows(shard)])
        written, began = 0, time.perf_counter()
        try:
            for k in range(rounds):
                # One boundary per round (every rank equally often). Finished shards are already saved
                # (each renamed into place whole); at a signal the round's count is what the run keeps.
                ctx.step_boundary(done_before + k * env.world_size, functools.partial(self._shards_done, done_before, written))
                if env.rank == 0:
                    self._progress(done_before + k * env.world_size, manifest, k * env.world_size, began)
                if k < len(mine) and self._make_shard(manifest, mine[k], stream):
                    written += 1
        finally:
            del stream  # stops the decoding workers
        done = self._shards_done(done_before, written)
        if dist.is_initialized() and env.world_size > 1:
            dist.barrier()  # every shard is renamed into place before rank 0 verifies
        result: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size, "shards_written": written,
                                  "shards_done": done, "shards": manifest.num_shards}
        if env.rank == 0:
            report = verify(self.out)
            log.info("%s", report.table())
            result.update(ok=report.ok, windows_stored=report.windows_stored)
            self._progress(done, manifest, len(remaining), began)
        ctx.finished(done)
        return result

    def _shards_done(self, done_before: int, written: int) -> int:
        """Shards finished by every rank so far (collective)."""
        import torch
        import torch.distributed as dist

        total = torch.tensor([written], dtype=torch.int64)
        if dist.is_initialized() and self.env.world_size > 1:
            dist.all_reduce(total)
        return done_before + int(total.item())

    def _agree_on_remaining(self, manifest: Manifest) -> list[int]:
        """Rank 0 lists the unfinished shards and every rank gets the same list (no one has written yet)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.env.rank == 0:
            (self.out / SHARD_DIR).mkdir(exist_ok=True)
            removed = remove_stale_temporaries(self.out, self.env.job_id)
            if removed:
                log.info("removed %d temporary shard file(s) left by an interrupted run", removed)
            done = finished_shards(self.out)
            box[0] = [shard for shard in range(manifest.num_shards) if shard not in done]
        if dist.is_initialized() and self.env.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return list(box[0])

    def _stream(self, clips: VideoFolderClips, windows: list[int]) -> Iterator[dict[str, Any]]:
        """This rank's windows in order, decoded ahead by worker processes while the teacher runs."""
        from torch.utils.data import DataLoader

        cpus = self.task.runtime.cpus_per_task
        workers = self.task.workers
        if workers is None:
            workers = max(1, min(8, cpus - 1)) if self.device.type == "cuda" else 0
        loader = DataLoader(_WindowReader(clips), batch_size=None, sampler=windows, num_workers=workers,
                            pin_memory=self.device.type == "cuda", prefetch_factor=4 if workers else None)
        return iter(loader)

    def _make_shard(self, manifest: Manifest, shard: int, stream: Iterator[dict[str, Any]]) -> bool:
        """Decode, encode and write one shard; False if a signal made us abandon it."""
        import torch

        windows = manifest.shard_windows(shard)
        frames, latents, stored, failed = [], [], [], []
        pending: list[dict[str, Any]] = []
        began = time.perf_counter()
        for n, window in enumerate(windows):
            if self.ctx.stop.reason and self._abandon(began, n, len(windows)):
                log.info("shard %d abandoned after %d of %d windows (%s): the next run redoes it",
                         shard, n, len(windows), self.ctx.stop.reason)
                return False
            item = next(stream)
            if item["window"] != window:  # the loader yields in sampler order; anything else is a bug
                raise RuntimeError(f"window stream out of order: got {item['window']}, expected {window}")
            if item["frames"] is None:
                failed.append([window, item["error"]])
                log.warning("shard %d: window %d (%s frame %d) not stored: %s", shard, window, *manifest.windows[window], item["error"])
                continue
            pending.append(item)
            if len(pending) == self.task.batch:
                self._encode(pending, frames, latents, stored)
                pending = []
        if pending:
            self._encode(pending, frames, latents, stored)
        t, h, w = manifest.spec
        tensors = {
            "frames": torch.cat(frames) if frames else torch.empty((0, t, 3, h, w), dtype=torch.uint8),
            "latents": torch.cat(latents) if latents else torch.empty(
                (0, t // TIME_FACTOR, self.latent_channels, h // SPATIAL_FACTOR, w // SPATIAL_FACTOR), dtype=torch.bfloat16),
        }
        meta = shard_metadata(shard, stored, [manifest.windows[w] for w in stored], failed, manifest.spec, time.perf_counter() - began, rank=self.env.rank,
                              job_id=self.env.job_id, teacher=f"{manifest.settings['teacher_kind']} {manifest.settings['teacher_path']}")
        write_shard(shard_path(self.out, shard), tensors, meta, tag=self.env.job_id)
        seconds = time.perf_counter() - began
        self.ctx.events.write("shard", shard=shard, rank=self.env.rank, segment=self.ctx.segment, job_id=self.env.job_id,
                              windows=len(stored), failed=len(failed), seconds=round(seconds, 4))
        log.info("shard %d: %d windows (%d failed) in %.2f s", shard, len(stored), len(failed), seconds)
        return True

    def _encode(self, items: list[dict[str, Any]], frames: list, latents: list, stored: list) -> None:
        import torch

        clip = torch.stack([item["frames"] for item in items])  # uint8 B×T×3×H×W (pinned on GPU runs)
        x = clip.to(self.device, non_blocking=True)
        if self.task.compile and self.device.type == "cuda" and len(items) < self.task.batch:
            # one shape for the compiled encoder: pad a short last batch with copies of its last clip
            x = torch.cat([x, x[-1:].expand(self.task.batch - len(items), *x.shape[1:])])
        # Teacher.latents is the trainer's own path: it encodes frames[:, :4L-3] (teacher_frame_count)
        z = self.teacher.latents(x)[: len(items)]
        latents.append(z.to(torch.bfloat16).cpu())
        frames.append(clip)
        stored.extend(int(item["window"]) for item in items)

    def _abandon(self, began: float, done: int, total: int) -> bool:
        stop = self.ctx.stop
        return should_abandon(done, total, time.perf_counter() - began, time.time() - (stop.signal_time or time.time()),
                              self.task.finish_budget_s.get(stop.reason or "preempted", 10.0))

    def _progress(self, done: int, manifest: Manifest, processed: int, began: float) -> None:
        """Rank 0's progress line in metrics.jsonl, so `jobs.status` and `JobHandle.wait` show shards done."""
        elapsed = time.perf_counter() - began
        row = {"step": done, "time": time.time(), "shards": manifest.num_shards,
               "shards_per_second": processed / elapsed if elapsed > 0 and processed else None}
        with open(self.ctx.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------- helpers


def _write_csv(path: Path, header: Sequence[str], rows: Any) -> None:
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    write_text_atomic(path, buf.getvalue())


# --------------------------------------------------------------------------------- submitting


def check_out(out: Path, settings: PrepareSettings) -> Manifest | None:
    """The saved plan when `out` holds this very preparation (resume), None for a new or empty folder."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a folder; pass a new folder path")
    content = []  # empty, or only the window list of an indexing that stopped before prepare.json: start afresh
    if out.is_dir():
        content = [p.name for p in out.iterdir() if p.name not in (VIDEOS_FILE, WINDOWS_FILE) and not p.name.startswith(".")]
    if not content:
        parent = out.parent if not out.exists() else out
        while not parent.exists():
            parent = parent.parent
        if not _writable(parent):
            raise PrepareError(f"--out {out}: {parent} is not writable by you; pick a folder you can write")
        return None
    if not (out / MANIFEST_FILE).is_file():
        raise PrepareError(f"--out {out} is not empty and holds no preparation ({MANIFEST_FILE}); pass a new or empty folder")
    if not _writable(out):
        raise PrepareError(f"--out {out} is not writable by you; pick a folder you can write")
    info = read_manifest_info(out)
    differ = [f"{key} {info.get(key)!r} → {value!r}" for key, value in settings.identity().items() if info.get(key) != value]
    if differ:
        raise PrepareError(f"--out {out} was prepared with other settings ({'; '.join(differ)}); use those settings to "
                           "resume it, or pass a new --out")
    return Manifest.read(out)


def submit_prepare(cluster: ClusterConfig, out: str | os.PathLike, run_name: str | None = None, batch: int = 4,
                   workers: int | None = None, compile: bool = False) -> JobHandle:
    """Submit the preparation of `out` (its manifest already written) as one job; returns its JobHandle."""
    from taehv_slurm.requeue import grace_seconds
    from taehv_slurm.submission import submit

    # After a signal a shard in progress is finished only if that fits well inside the signal's grace
    # (half of it: the save, the requeue and the exit need the rest).
    budget = {reason: seconds / 2 for reason, seconds in grace_seconds(cluster.signal_delay_s, cluster.kill_wait_s).items()}
    # The device follows the cluster shape: ranks of a GPU-less config stay on the CPU even where CUDA exists.
    runtime = cluster.runtime(device=cluster.task_device())
    out = Path(out).resolve()
    task = PrepareTask(str(out), runtime, batch=batch, workers=workers, compile=compile, finish_budget_s=budget)
    name = run_name or f"prepare-{out.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # manifest.total_steps: jobs.status and JobHandle.wait show shards done / shards (rank 0 logs them as steps)
    record = {"task_kind": "prepare", "out": str(out), "plan": {"total_steps": read_manifest_info(out)["shards"]}}
    return submit(task, cluster, name, record=record)


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)
