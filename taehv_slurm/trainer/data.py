"""Clip sources and a deterministic, resumable, world-size-independent sample order.

Clips travel as uint8 T×3×H×W tensors (4× smaller than float); the trainer converts them to float in
[0, 1] on the device.

Sample order: one global, infinite stream of item indices (:class:`GlobalOrder`, a fresh permutation
per epoch). Optimizer step s consumes stream positions [s·E, (s+1)·E) for the effective batch E, and
the ranks split that range into consecutive shares (taehv_slurm.common.plan: ⌊E/W⌋ or one more each). So what
a step sees depends on E and s only: a job resumed at step s on a different number of GPUs (same E)
trains on exactly the clips it would have seen.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from taehv_slurm.common.config import VIDEO_EXTENSIONS
from taehv_slurm.common.train_config import video_folder_missing
from taehv_slurm.runtime.signals import ignore_in_worker
from taehv_slurm.trainer.shared_memory import batches, in_shared_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClipSpec:
    frames: int = 12
    height: int = 480
    width: int = 720


# ----------------------------------------------------------------------------------------------------
# Synthetic clips


class SyntheticClips(Dataset):
    """Moving, rotating textured shapes over a panning textured gradient background.

    Deterministic per (seed, index) and independent of any global RNG, so DataLoader workers agree.
    Motion is smooth and sub-pixel (analytic shapes with anti-aliased edges), so an autoencoder can
    learn it — unlike noise. Cost is a few vectorized numpy passes per clip.
    """

    def __init__(self, num_clips: int, spec: ClipSpec, seed: int = 0) -> None:
        if num_clips < 1:
            raise ValueError(f"SyntheticClips needs num_clips >= 1, got {num_clips}")
        self.num_clips, self.spec, self.seed = num_clips, spec, seed
        self.skipped: dict[str, int] = {}

    def __len__(self) -> int:
        return self.num_clips

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_clips:
            raise IndexError(f"clip {index} out of range [0, {self.num_clips})")
        rng = np.random.default_rng((self.seed, index))
        frames = _render_clip(rng, self.spec.frames, self.spec.height, self.spec.width)
        return {"frames": torch.from_numpy(frames), "index": index}


def _render_clip(rng: np.random.Generator, t_len: int, height: int, width: int) -> np.ndarray:
    """T×3×H×W uint8. Layout and motion are in units of the short side (the same scene at any size);
    texture frequencies are capped in pixels so small renders do not alias.

    Everything stays float32 (scalars as Python floats): a NumPy float64 scalar would silently
    promote whole T×H×W arrays to float64 and double the cost.
    """
    unit = float(min(height, width))
    ys = (np.arange(height, dtype=np.float32) + 0.5) / unit
    xs = (np.arange(width, dtype=np.float32) + 0.5) / unit
    ts = np.arange(t_len, dtype=np.float32)

    # Background: a two-color linear gradient plus two drifting gratings, tinted.
    c0, c1 = rng.uniform(0.1, 0.9, (2, 3)).astype(np.float32)
    g_dir = float(rng.uniform(0, 2 * np.pi))
    g = math.cos(g_dir) * xs[None, :] + math.sin(g_dir) * ys[:, None]
    g = (g - g.min()) / max(float(g.max() - g.min()), 1e-6)
    base = c0[:, None, None] + (c1 - c0)[:, None, None] * g[None]  # 3×H×W
    pan = rng.uniform(-0.01, 0.01, 2)  # short sides per frame
    tex = np.zeros((t_len, height, width), np.float32)
    # Periods of at least ~8 pixels: finer patterns alias into noise at small render sizes.
    max_cycles = max(3.0, min(30.0, unit / 8))
    for _ in range(2):
        freq = float(rng.uniform(2, max_cycles)) * 2 * math.pi  # cycles per short side
        theta = float(rng.uniform(0, math.pi))
        kx, ky = freq * math.cos(theta), freq * math.sin(theta)
        phase = (float(rng.uniform(0, 2 * math.pi)) - (kx * float(pan[0]) + ky * float(pan[1])) * ts)
        arg = (kx * xs)[None, None, :] + (ky * ys)[None, :, None] + phase[:, None, None]
        tex += np.sin(arg, out=arg)
    tint = rng.uniform(0.03, 0.12, 3).astype(np.float32)
    img = base[None] + tint[None, :, None, None] * tex[:, None]  # T×3×H×W float32

    for _ in range(int(rng.integers(2, 6))):
        _draw_shape(rng, img, xs, ys, ts, unit)

    np.clip(img, 0.0, 1.0, out=img)
    img *= 255.0
    img += 0.5
    return img.astype(np.uint8)


def _draw_shape(rng: np.random.Generator, img: np.ndarray, xs: np.ndarray, ys: np.ndarray,
                ts: np.ndarray, unit: float) -> None:
    """Composite one moving, rotating, striped ellipse or rectangle into img (T×3×H×W) in place."""
    extent = (float(xs[-1]) + 0.5 / unit, float(ys[-1]) + 0.5 / unit)
    sx, sy = (float(v) for v in rng.uniform(0.06, 0.25, 2))  # half-axes, short sides
    px, py = float(rng.uniform(0.1, 0.9)) * extent[0], float(rng.uniform(0.1, 0.9)) * extent[1]
    vx, vy = (float(v) for v in rng.uniform(-0.025, 0.025, 2))
    ang0, spin = float(rng.uniform(0, 2 * math.pi)), float(rng.uniform(-0.12, 0.12))
    is_ellipse = bool(rng.random() < 0.5)
    color = rng.uniform(0, 1, 3).astype(np.float32)
    stripe_cycles = float(rng.uniform(6, max(8.0, min(32.0, unit / 6))))  # per short side, >= ~6 px period
    stripe_freq, stripe_amp = 2 * math.pi * stripe_cycles, float(rng.uniform(0.0, 0.4))

    # Only touch the pixels the shape can reach over the whole clip (bounding box of its path).
    reach = math.hypot(sx, sy) + 2.0 / unit
    t_end = float(ts[-1])
    x_lo, x_hi = min(px, px + vx * t_end) - reach, max(px, px + vx * t_end) + reach
    y_lo, y_hi = min(py, py + vy * t_end) - reach, max(py, py + vy * t_end) + reach
    xi = np.nonzero((xs >= x_lo) & (xs <= x_hi))[0]
    yi = np.nonzero((ys >= y_lo) & (ys <= y_hi))[0]
    if xi.size == 0 or yi.size == 0:
        return
    xs_b, ys_b = xs[xi[0]: xi[-1] + 1], ys[yi[0]: yi[-1] + 1]

    cx, cy = (px + vx * ts)[:, None, None], (py + vy * ts)[:, None, None]
    ang = ang0 + spin * ts
    cos, sin = np.cos(ang)[:, None, None], np.sin(ang)[:, None, None]
    dx, dy = xs_b[None, None, :] - cx, ys_b[None, :, None] - cy
    u, v = cos * dx + sin * dy, cos * dy - sin * dx  # shape-local coordinates (T×h×w)
    if is_ellipse:
        r = np.sqrt(np.square(u / sx) + np.square(v / sy))
        dist = (1.0 - r) * min(sx, sy)  # approximate signed distance, > 0 inside
    else:
        dist = np.minimum(sx - np.abs(u), sy - np.abs(v))
    alpha = np.clip(dist * unit + 0.5, 0.0, 1.0)[:, None]  # ~1-pixel anti-aliased edge
    shade = 1.0 - stripe_amp * (0.5 + 0.5 * np.sin(stripe_freq * u))  # texture rides with the shape
    fill = color[None, :, None, None] * shade[:, None]
    region = img[:, :, yi[0]: yi[-1] + 1, xi[0]: xi[-1] + 1]
    region += alpha * (fill - region)


# ----------------------------------------------------------------------------------------------------
# Video files


@dataclass(frozen=True)
class VideoInfo:
    """What indexing learned about one file (enough to seek without reopening the header twice)."""

    num_frames: int
    rate: Fraction  # frames per second
    time_base: Fraction  # seconds per pts tick
    start_pts: int
    counted_by: str  # "header" or "demux"


class WindowDecodeError(RuntimeError):
    pass


class VideoFolderClips(Dataset):
    """Fixed-length windows of every video under ``root`` (recursive, sorted by path).

    - Windows of ``spec.frames`` frames start every ``stride`` frames (default: non-overlapping).
    - Frame counts come from the stream header, else from counting demuxed packets (no decoding;
      Matroska/WebM usually carry no count).
    - Reading a window seeks to the keyframe at or before its first frame and decodes forward.
    - Each frame is resized (keeping aspect ratio, square pixels assumed) to the smallest size that
      covers spec.height × spec.width, then center-cropped: deterministic, no augmentation.
    - Files that cannot be opened, have no video stream or are shorter than one window are skipped at
      index time with one warning each and counted in ``skipped`` by reason. A window that fails to
      decode at read time is replaced by the next decodable window (wrapping around), deterministically,
      and counted. ``skipped`` counts live in the process that did the work (DataLoader workers keep
      their own copies).
    - ``windows`` lists (path, start_frame) per item, so an index (e.g. of precomputed latents) can be
      written against it; ``"index"`` in an item is the window actually returned.
    ``seed`` is kept for per-item randomness derived from (seed, index); the current pipeline has none.
    """

    def __init__(self, root: str | Path, spec: ClipSpec, stride: int | None = None,
                 extensions: Sequence[str] = VIDEO_EXTENSIONS, seed: int = 0) -> None:
        self.root, self.spec, self.seed = Path(root), spec, seed
        self.stride = spec.frames if stride is None else stride
        if self.stride < 1:
            raise ValueError(f"VideoFolderClips: stride must be >= 1, got {self.stride}")
        self.extensions = tuple(e.lower() for e in extensions)
        self.skipped: dict[str, int] = {}
        self.videos: dict[str, VideoInfo] = {}
        self.windows: list[tuple[str, int]] = []
        self._bad_windows: set[int] = set()

        if not self.root.is_dir():
            raise ValueError(video_folder_missing(self.root, self.extensions))
        files = sorted((p for p in self.root.rglob("*")
                        if p.suffix.lower() in self.extensions and p.is_file()),
                       key=lambda p: p.relative_to(self.root).as_posix())
        if not files:
            raise ValueError(f"video folder {str(self.root)!r} holds no {'/'.join(self.extensions)} files; "
                             f"add videos there or pass another folder / extensions")
        for path in files:
            info = self._probe(path)
            if info is None:
                continue
            key = str(path)
            self.videos[key] = info
            self.windows.extend((key, s) for s in range(0, info.num_frames - spec.frames + 1, self.stride))
        if not self.windows:
            raise ValueError(f"video folder {str(self.root)!r}: none of {len(files)} files yields a "
                             f"{spec.frames}-frame window (skipped: {self.skipped}); see the warnings above")

    @classmethod
    def from_index(cls, root: str | Path, spec: ClipSpec, videos: dict[str, VideoInfo],
                   windows: Sequence[tuple[str, int]], stride: int | None = None) -> VideoFolderClips:
        """Rebuild from the ``videos`` and ``windows`` of an earlier instance without probing the files
        again (each rank of a preparation job would otherwise re-read every header: O(dataset) per rank)."""
        self = cls.__new__(cls)
        self.root, self.spec, self.seed = Path(root), spec, 0
        self.stride = spec.frames if stride is None else stride
        self.extensions = ()
        self.skipped, self.videos, self.windows = {}, dict(videos), list(windows)
        self._bad_windows = set()
        return self

    def read_window(self, index: int) -> torch.Tensor:
        """Window ``index`` exactly (T×3×H×W uint8); raises on a decode error instead of substituting
        the next window as ``__getitem__`` does (an index of stored windows must name what it stores)."""
        path, start = self.windows[index]
        return torch.from_numpy(self._decode_window(path, start)).permute(0, 3, 1, 2).contiguous()

    def _skip(self, reason: str, path: Path | str, detail: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        log.warning("skipping %s: %s (%s)", path, reason, detail)

    def _probe(self, path: Path) -> VideoInfo | None:
        try:
            probed = self._read_header(path)
        except Exception as e:  # anything PyAV/FFmpeg rejects: never let one file stop indexing
            self._skip("unreadable", path, f"{type(e).__name__}: {e}")
            return None
        if isinstance(probed, str):
            self._skip(probed, path, probed.replace("_", " "))
            return None
        info, damage = probed
        if info.num_frames < self.spec.frames:
            self._skip("too_short", path, f"{info.num_frames} frames < {self.spec.frames}"
                       + (f"; {damage}" if damage else ""))
            return None
        if damage:
            log.warning("%s: %s; using the frames before it", path, damage)
        return info

    @staticmethod
    def _read_header(path: Path) -> tuple[VideoInfo, str] | str:
        """(info, damage note) or a skip reason. Frame count from the header, else by demuxing."""
        import av

        # Read every stream attribute while the container is open: PyAV streams of a closed container
        # are dangling (touching them can segfault).
        with av.open(str(path)) as container:
            if not container.streams.video:
                return "no_video_stream"
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            time_base = stream.time_base
            if not rate or not time_base:
                return "no_frame_rate"
            start_pts = stream.start_time if stream.start_time is not None else 0
            num_frames, counted_by, damage = int(stream.frames or 0), "header", ""
            if num_frames <= 0:
                counted_by = "demux"
                try:
                    for packet in container.demux(stream):
                        if packet.size:  # the demuxer ends with an empty flush packet
                            num_frames += 1
                except Exception as e:  # damaged tail: keep what was countable
                    damage = f"packet count stopped early at {num_frames} ({type(e).__name__}: {e})"
        return VideoInfo(num_frames, Fraction(rate), Fraction(time_base), int(start_pts), counted_by), damage

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.windows)
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range [0, {n})")
        for j in (index + k for k in range(n)):
            j %= n
            if j in self._bad_windows:
                continue
            path, start = self.windows[j]
            try:
                frames = self._decode_window(path, start)
            except Exception as e:
                self._bad_windows.add(j)
                self._skip("decode_error", f"{path} frames {start}..{start + self.spec.frames - 1}",
                           f"{type(e).__name__}: {e}; using the next window")
                continue
            return {"frames": torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(), "index": j}
        raise RuntimeError(f"no window under {self.root} could be decoded")

    def _decode_window(self, path: str, start: int) -> np.ndarray:
        """T×H×W×3 uint8: the spec.frames consecutive frames from the first one at or after ``start``."""
        frames = self._decode_from(path, start, seek=start > 0)
        if frames is None:  # the seek landed past the window (bad keyframe index): decode from the top
            frames = self._decode_from(path, start, seek=False)
        if frames is None or len(frames) < self.spec.frames:
            got = 0 if frames is None else len(frames)
            raise WindowDecodeError(f"decoded {got} of {self.spec.frames} frames")
        return np.stack(frames)

    def _decode_from(self, path: str, start: int, seek: bool) -> list[np.ndarray] | None:
        import av

        info = self.videos[path]
        ticks_per_frame = 1 / (info.rate * info.time_base)
        out: list[np.ndarray] = []
        with av.open(path) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if seek:
                # Floor: landing on an earlier keyframe costs a little decoding; a later one loses frames.
                container.seek(info.start_pts + math.floor(start * ticks_per_frame), stream=stream,
                               backward=True, any_frame=False)
            for count, frame in enumerate(container.decode(stream)):
                if frame.pts is not None:
                    idx = round((frame.pts - info.start_pts) / ticks_per_frame)
                elif seek:
                    return None  # no timestamps: the position after a seek is unknown
                else:
                    idx = count  # decoding from the top: position = decode order
                if idx < start:
                    continue
                if not out and seek and idx > start:
                    return None
                out.append(self._to_rgb(frame))
                if len(out) == self.spec.frames:
                    break
        return out

    def _to_rgb(self, frame: Any) -> np.ndarray:
        """Cover-resize then center-crop one decoded frame to spec.height × spec.width (H×W×3 uint8)."""
        h, w = self.spec.height, self.spec.width
        scale = max(h / frame.height, w / frame.width)
        rh, rw = max(h, round(frame.height * scale)), max(w, round(frame.width * scale))
        interp = "AREA" if scale < 1 else "BICUBIC"
        # Colorspace comes from the frame; pass its range too (full-range "JPEG" video would otherwise
        # be read as limited range and lose contrast). One thread: PyAV keeps one scaler per thread, and a
        # loader worker forked after this process scaled on FFmpeg's threads waits forever for them.
        rgb = frame.to_ndarray(format="rgb24", width=rw, height=rh, interpolation=interp,
                               src_color_range=frame.color_range or None, threads=1)
        top, left = (rh - h) // 2, (rw - w) // 2
        return np.ascontiguousarray(rgb[top: top + h, left: left + w])


# ----------------------------------------------------------------------------------------------------
# Deterministic, resumable, world-size-independent order

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on uint64 arrays (wrapping arithmetic): a fixed, version-proof hash."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class GlobalOrder:
    """Infinite stream of item indices; epoch e = pos // num_items is a permutation seeded by (seed, e).

    The permutation is defined by our own hash (argsort of SplitMix64 keys), not by a library RNG, so
    the order never changes with numpy/torch versions — a resumed job sees the same clips.
    """

    def __init__(self, num_items: int, seed: int) -> None:
        if num_items < 1:
            raise ValueError(f"GlobalOrder needs num_items >= 1, got {num_items}")
        self.num_items, self.seed = num_items, seed
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            with np.errstate(over="ignore"):
                base = _splitmix64(np.array([(self.seed * 0x632BE59BD9B4E019 + epoch) & _MASK64], np.uint64))
                keys = _splitmix64(base + np.arange(self.num_items, dtype=np.uint64))
            perm = np.argsort(keys, kind="stable")
            if len(self._cache) >= 2:  # consecutive steps straddle at most two epochs
                self._cache.pop(next(iter(self._cache)))
            self._cache[epoch] = perm
        return perm

    def epoch_of(self, pos: int) -> int:
        if pos < 0:
            raise ValueError(f"stream position must be >= 0, got {pos}")
        return pos // self.num_items

    def item_at(self, pos: int) -> int:
        return int(self.permutation(self.epoch_of(pos))[pos % self.num_items])

    def __getstate__(self) -> dict[str, Any]:
        return {"num_items": self.num_items, "seed": self.seed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["num_items"], state["seed"])  # type: ignore[misc]


def step_indices(order: GlobalOrder, step: int, effective_batch: int, first: int,
                 sizes: Sequence[int]) -> list[list[int]]:
    """Item indices of one rank's micro-batches of optimizer step ``step``.

    The step covers stream positions [step·E, (step+1)·E); the rank's share starts ``first`` positions
    in and is cut into micro-batches of ``sizes`` (taehv_slurm.common.plan.ScalePlan.microbatch_sizes). A size
    of 0 is a padding micro-batch: it repeats the rank's last sample and is trained with weight 0.
    """
    share = sum(sizes)
    if step < 0 or first < 0 or min(sizes, default=0) < 0 or share < 1 or first + share > effective_batch:
        raise ValueError(f"step_indices: bad layout step={step} effective_batch={effective_batch} "
                         f"first={first} sizes={list(sizes)}")
    pos = step * effective_batch + first
    out = []
    for size in sizes:
        out.append([order.item_at(p) for p in range(pos, pos + size)] if size else [order.item_at(pos - 1)])
        pos += size
    return out


def collate_clips(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors, turn int/float fields into tensors, keep anything else as a list."""
    out: dict[str, Any] = {}
    for key in items[0]:
        vals = [it[key] for it in items]
        first = vals[0]
        if isinstance(first, torch.Tensor):
            out[key] = default_collate(vals)  # torch.stack; in a worker, into shared memory
        elif isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            out[key] = in_shared_memory(torch.tensor(vals, dtype=torch.long))
        elif isinstance(first, (float, np.floating)):
            out[key] = in_shared_memory(torch.tensor(vals, dtype=torch.float32))
        else:
            out[key] = vals
    return out


class _StepBatchSampler:
    """Infinite batch sampler: this rank's micro-batches of steps start_step, start_step + 1, …"""

    def __init__(self, order: GlobalOrder, start_step: int, effective_batch: int, first: int,
                 sizes: Sequence[int]) -> None:
        self.order, self.start_step = order, start_step
        self.layout = (effective_batch, first, list(sizes))

    def __iter__(self) -> Iterator[list[int]]:
        for step in itertools.count(self.start_step):
            yield from step_indices(self.order, step, *self.layout)


def microbatches(source: Dataset, order: GlobalOrder, start_step: int, effective_batch: int, first: int,
                 sizes: Sequence[int], num_workers: int = 0, prefetch_factor: int = 2,
                 pin_memory: bool = False) -> Iterator[dict[str, Any]]:
    """This rank's micro-batches, one after another, from ``start_step`` on: ``len(sizes)`` per step
    (see ``step_indices``), so the trainer can start on one while the workers load the next.

    Each micro-batch: "frames" uint8 B×T×3×H×W, "index" LongTensor (B,), and any other fields of the
    source stacked. Workers load in parallel but batches arrive in order, so the stream is the same for
    any ``num_workers``. Close the generator (or drop it) to stop the workers.
    """
    if order.num_items != len(source):  # type: ignore[arg-type]
        raise ValueError(f"microbatches: order covers {order.num_items} items but the source has "
                         f"{len(source)}; build GlobalOrder(len(source), seed)")  # type: ignore[arg-type]
    sampler = _StepBatchSampler(order, start_step, effective_batch, first, sizes)
    extra: dict[str, Any] = {"prefetch_factor": prefetch_factor} if num_workers > 0 else {}
    loader = DataLoader(source, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_clips,
                        pin_memory=pin_memory, worker_init_fn=ignore_in_worker, **extra)
    yield from batches(loader)
