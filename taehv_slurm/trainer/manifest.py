"""What a prepared folder holds: the settings (`PrepareSettings`), and the window list written before any
shard (`Manifest`: prepare.json + videos.csv + windows.csv).

Layout of a prepared folder:

    prepare.json      what is prepared: data root, clip spec, stride, shard size, teacher; counts
    videos.csv        per video: path (relative to the data root), frame count, rate, time base, start pts
    windows.csv       the expected windows (id = row): video, window_start, shard — what verify checks against
    shards/           the shards (taehv_slurm.trainer.shards), written by the preparation job
    index.csv         written by `verify` once every shard is there: window, video, window_start, shard,
                      offset

Windows come from `VideoFolderClips` (the training windowing). Torch is imported only by
`index_windows` and `open_clips`: the CLI's --help, --dry-run and --verify stay light.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taehv_slurm.common.config import TEACHER_KINDS, VIDEO_EXTENSIONS, ConfigError
from taehv_slurm.common.messages import command
from taehv_slurm.common.runfolder import write_text_atomic
from taehv_slurm.common.train_config import prepared_folder_missing
from taehv_slurm.trainer.shapes import SPATIAL_FACTOR, TIME_FACTOR

if TYPE_CHECKING:
    from taehv_slurm.trainer.data import VideoFolderClips

FORMAT = "taehv-prepared/1"
MANIFEST_FILE, VIDEOS_FILE, WINDOWS_FILE, INDEX_FILE = ("prepare.json", "videos.csv", "windows.csv",
                                                        "index.csv")
# Settings that define what a folder holds: a resubmission must match them to resume it.
IDENTITY_KEYS = ("data", "frames", "height", "width", "stride", "shard_size", "teacher_kind", "teacher_path",
                 "scaling_factor", "seed")


class PrepareError(ConfigError):
    """Bad input for a preparation (data, output folder, teacher); the message is one line naming the fix."""


@dataclass(frozen=True)
class PrepareSettings:
    """What to prepare. Every field but the data root has the training defaults (12 × 480 × 720)."""

    data: str
    frames: int = 12
    height: int = 480
    width: int = 720
    # frames between window starts; None: non-overlapping (= frames), as in training
    stride: int | None = None
    shard_size: int = 32  # windows per shard: 32 × 12 × 480 × 720 × 3 B ≈ 400 MB files
    teacher_kind: str = "hunyuanvideo"
    teacher_path: str = ""
    scaling_factor: float | None = None  # None: the VAE config's value
    seed: int = 0  # seed of a built-in random teacher (random:tiny)

    def validate(self) -> PrepareSettings:
        """Check without importing torch; returns a copy with absolute paths and the stride filled in."""
        if self.frames < TIME_FACTOR or self.frames % TIME_FACTOR:
            raise PrepareError(f"--frames must be a multiple of {TIME_FACTOR} "
                               f"(TAEHV encodes 4 frames per latent), got {self.frames}")
        if min(self.height, self.width) <= 0 or self.height % SPATIAL_FACTOR or self.width % SPATIAL_FACTOR:
            raise PrepareError(f"--height and --width must be positive multiples of {SPATIAL_FACTOR}, "
                               f"got {self.height}×{self.width}")
        if self.shard_size < 1:
            raise PrepareError(f"--shard-size must be ≥ 1, got {self.shard_size}")
        stride = self.frames if self.stride is None else self.stride
        if stride < 1:
            raise PrepareError(f"--stride must be ≥ 1, got {stride}")
        data = Path(self.data).expanduser()
        if not data.is_dir():
            raise PrepareError(f"data folder {self.data} does not exist or is not a folder; "
                               f"pass --data a folder of {'/'.join(VIDEO_EXTENSIONS)} files")
        if not any(count_videos(data, limit=1)):
            raise PrepareError(f"data folder {self.data} holds no {'/'.join(VIDEO_EXTENSIONS)} files; "
                               "add videos there or pass another --data")
        if self.teacher_kind not in TEACHER_KINDS:
            raise PrepareError(f"--teacher-kind {self.teacher_kind!r} is not one of "
                               f"{', '.join(TEACHER_KINDS)}")
        teacher_path = self.teacher_path
        if not teacher_path:
            raise PrepareError("--teacher-path is missing: pass a local diffusers VAE folder "
                               "(config.json + weights)")
        if teacher_path.startswith("random:"):
            if teacher_path != "random:tiny" or self.teacher_kind != "hunyuanvideo":
                raise PrepareError(f"--teacher-path {teacher_path}: the only built-in teacher is random:tiny "
                                   "(kind hunyuanvideo); pass a local diffusers VAE folder otherwise")
        else:
            folder = Path(teacher_path).expanduser()
            if not (folder / "config.json").is_file():
                raise PrepareError(f"--teacher-path {teacher_path}: no diffusers VAE there "
                                   "(no config.json); point it at a local folder saved with save_pretrained "
                                   "(e.g. the 'vae' folder of the model)")
            teacher_path = str(folder.resolve())
        return PrepareSettings(str(data.resolve()), self.frames, self.height, self.width, stride,
                               self.shard_size, self.teacher_kind, teacher_path, self.scaling_factor,
                               self.seed)

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
        return (f"{frames}×{height}×{width} windows (stride {s['stride']}) of {len(self.videos)} videos "
                f"in {s['data']}; "
                f"teacher {s['teacher_kind']} {s['teacher_path']}; {len(self.windows)} windows in "
                f"{self.num_shards} shards of {self.shard_size}")

    def write(self, out: Path) -> None:
        """prepare.json last: its presence means the window list beside it is complete."""
        rows = [(rel, info["num_frames"], info["rate"], info["time_base"], info["start_pts"],
                 info["counted_by"])
                for rel, info in self.videos.items()]
        write_csv(out / VIDEOS_FILE, ("video", "num_frames", "rate", "time_base", "start_pts", "counted_by"),
                  rows)
        write_csv(out / WINDOWS_FILE, ("window", "video", "window_start", "shard"),
                   ((i, rel, start, i // self.shard_size) for i, (rel, start) in enumerate(self.windows)))
        info = {"format": FORMAT, **self.settings, "videos": len(self.videos), "windows": len(self.windows),
                "shards": self.num_shards, "skipped": self.skipped, "created": self.created,
                "index_seconds": round(self.index_seconds, 3),
                "teacher_frames": self.spec[0] - (TIME_FACTOR - 1),
                "latent_frames": self.spec[0] // TIME_FACTOR}
        write_text_atomic(out / MANIFEST_FILE, json.dumps(info, indent=1) + "\n")

    @classmethod
    def read(cls, out: str | os.PathLike) -> Manifest:
        out = Path(out)
        info = read_manifest_info(out)
        with open(out / VIDEOS_FILE, newline="") as f:
            videos = {row["video"]: {"num_frames": int(row["num_frames"]), "rate": row["rate"],
                                     "time_base": row["time_base"],
                                     "start_pts": int(row["start_pts"]), "counted_by": row["counted_by"]}
                      for row in csv.DictReader(f)}
        with open(out / WINDOWS_FILE, newline="") as f:
            windows = [(row["video"], int(row["window_start"])) for row in csv.DictReader(f)]
        if len(windows) != info["windows"]:
            raise PrepareError(f"{out / WINDOWS_FILE} lists {len(windows)} windows but "
                               f"{MANIFEST_FILE} says {info['windows']}; "
                               "the folder was changed by hand: prepare into a new --out")
        return cls({k: info[k] for k in IDENTITY_KEYS}, videos, windows, dict(info.get("skipped", {})),
                   float(info.get("created", 0.0)), float(info.get("index_seconds", 0.0)))


def read_manifest_info(out: str | os.PathLike) -> dict[str, Any]:
    """prepare.json of a prepared folder, or a one-line PrepareError saying what the folder is not."""
    out = Path(out)
    if not out.is_dir():
        raise PrepareError(prepared_folder_missing(out))
    path = out / MANIFEST_FILE
    if not path.is_file():
        raise PrepareError(f"{out} is not a prepared data folder (no {MANIFEST_FILE}); prepare it with "
                           f"`{command('prepare')} --data VIDEOS --out {out} --teacher-path VAE`")
    try:
        info = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PrepareError(f"{path} is unreadable ({err}); prepare into a new --out") from None
    if info.get("format") != FORMAT:
        raise PrepareError(f"{path} has format {info.get('format')!r}, this code reads {FORMAT!r}; "
                           "prepare again into a new --out")
    return info


def index_windows(settings: PrepareSettings) -> Manifest:
    """Index the videos with the training windowing (VideoFolderClips) into a Manifest. Imports torch."""
    from taehv_slurm.trainer.data import ClipSpec, VideoFolderClips

    start = time.perf_counter()
    root = Path(settings.data)
    try:
        clips = VideoFolderClips(root, ClipSpec(settings.frames, settings.height, settings.width),
                                 stride=settings.stride)
    except ValueError as err:  # no files / no window: already one line naming the folder and the fix
        raise PrepareError(str(err)) from None
    videos = {_relative(key, root): {"num_frames": info.num_frames, "rate": str(info.rate),
                                     "time_base": str(info.time_base),
                                     "start_pts": info.start_pts, "counted_by": info.counted_by}
              for key, info in clips.videos.items()}
    windows = [(_relative(key, root), start_frame) for key, start_frame in clips.windows]
    return Manifest(settings.identity(), videos, windows, dict(clips.skipped), time.time(),
                    time.perf_counter() - start)


def _relative(key: str, root: Path) -> str:
    return Path(key).relative_to(root).as_posix()


def open_clips(manifest: Manifest) -> VideoFolderClips:
    """The manifest's windows as a VideoFolderClips, rebuilt from the saved index (no re-probing of files)."""
    from taehv_slurm.trainer.data import ClipSpec, VideoFolderClips, VideoInfo

    root = Path(manifest.settings["data"])
    videos = {str(root / rel): VideoInfo(v["num_frames"], Fraction(v["rate"]), Fraction(v["time_base"]),
                                         v["start_pts"],
                                         v["counted_by"]) for rel, v in manifest.videos.items()}
    windows = [(str(root / rel), start) for rel, start in manifest.windows]
    return VideoFolderClips.from_index(root, ClipSpec(*manifest.spec), videos, windows,
                                       stride=int(manifest.settings["stride"]))


def write_csv(path: Path, header: Sequence[str], rows: Any) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    write_text_atomic(path, buf.getvalue())


def check_out(out: Path, settings: PrepareSettings) -> Manifest | None:
    """The saved plan when `out` holds this very preparation (resume), None for a new or empty folder."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a folder; pass a new folder path")
    # empty, or only the window list of an indexing that stopped before prepare.json: start afresh
    content = []
    if out.is_dir():
        content = [p.name for p in out.iterdir()
                   if p.name not in (VIDEOS_FILE, WINDOWS_FILE) and not p.name.startswith(".")]
    if not content:
        parent = out.parent if not out.exists() else out
        while not parent.exists():
            parent = parent.parent
        if not _writable(parent):
            raise PrepareError(f"--out {out}: {parent} is not writable by you; pick a folder you can write")
        return None
    if not (out / MANIFEST_FILE).is_file():
        raise PrepareError(f"--out {out} is not empty and holds no preparation ({MANIFEST_FILE}); "
                           "pass a new or empty folder")
    if not _writable(out):
        raise PrepareError(f"--out {out} is not writable by you; pick a folder you can write")
    info = read_manifest_info(out)
    differ = [f"{key} {info.get(key)!r} → {value!r}" for key, value in settings.identity().items()
              if info.get(key) != value]
    if differ:
        raise PrepareError(f"--out {out} was prepared with other settings ({'; '.join(differ)}); "
                           "use those settings to resume it, or pass a new --out")
    return Manifest.read(out)


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)
