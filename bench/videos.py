"""Write small real video files with PyAV, for the data tests and the bench scripts (bench/submit_checks.py).

Frame k of a solid-pattern video is one flat color that encodes k (``frame_color``), so a decoded
window can be checked for frame order after lossy coding.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

# Preferred encoders per container, best first; the first one this PyAV wheel can write wins.
CODEC_CHOICES = {
    ".mp4": ("libx264", "mpeg4"),
    ".mov": ("libx264", "mpeg4"),
    ".mkv": ("libx264", "mpeg4", "ffv1"),
    ".webm": ("libvpx-vp9", "libvpx"),
}

COLOR_STEP = 12  # per-frame step of the red channel; well above the lossy-coding error on flat frames
CYCLE = 18  # frames per red cycle; green changes between cycles


def can_write(codec: str) -> bool:
    try:
        av.codec.Codec(codec, "w")
    except Exception:
        return False
    return True


def pick_codec(suffix: str) -> str:
    for name in CODEC_CHOICES[suffix]:
        if can_write(name):
            return name
    raise RuntimeError(f"this PyAV wheel can write none of {CODEC_CHOICES[suffix]}")


def frame_color(k: int) -> tuple[int, int, int]:
    """A flat RGB color unique to frame k for k < 3·CYCLE; neighbours differ by COLOR_STEP in red."""
    return (16 + COLOR_STEP * (k % CYCLE), 200 - 70 * ((k // CYCLE) % 3), 96)


def nearest_frame(rgb: np.ndarray, candidates: range) -> int:
    """The k in ``candidates`` whose color is closest to the mean color of a 3×H×W or H×W×3 frame."""
    mean = rgb.reshape(3, -1).mean(1) if rgb.shape[0] == 3 else rgb.reshape(-1, 3).mean(0)
    return min(candidates, key=lambda k: float(np.abs(mean - np.array(frame_color(k))).sum()))


def solid_frame(k: int, width: int, height: int) -> np.ndarray:
    return np.broadcast_to(np.array(frame_color(k), np.uint8), (height, width, 3)).copy()


def noisy_frame(k: int, width: int, height: int) -> np.ndarray:
    """The frame's flat color on top, seeded noise in the bottom quarter (large packets, so a cut
    through the file lands in frame data rather than in the header)."""
    img = solid_frame(k, width, height)
    rows = height // 4
    img[height - rows:] = np.random.default_rng(k).integers(0, 256, (rows, width, 3), dtype=np.uint8)
    return img


def thirds_frame(k: int, width: int, height: int) -> np.ndarray:
    """Left third blue, right third red, middle third the frame's color (checks the center crop)."""
    img = solid_frame(k, width, height)
    img[:, : width // 3] = (0, 0, 255)
    img[:, width - width // 3:] = (255, 0, 0)
    return img


def write_video(
    path: str | Path,
    num_frames: int,
    width: int,
    height: int,
    fps: int = 8,
    codec: str | None = None,
    frame_fn: Callable[[int, int, int], np.ndarray] = solid_frame,
    gop: int = 4,
    options: dict[str, str] | None = None,
    container_options: dict[str, str] | None = None,
) -> str:
    """Encode ``num_frames`` frames of ``frame_fn(k, width, height)``; returns the codec used.

    A short GOP puts several keyframes in a tiny file so reading a later window really seeks.
    """
    path = Path(path)
    codec = codec or pick_codec(path.suffix)
    opts = dict(options or {})
    if codec.startswith("libvpx"):
        opts.setdefault("deadline", "realtime")
        opts.setdefault("cpu-used", "8")
    with av.open(str(path), "w", options=container_options or {}) as out:
        stream = out.add_stream(codec, rate=fps, options=opts)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        stream.bit_rate = 4_000_000  # tiny frames: keeps flat colors within a few levels for every codec
        for k in range(num_frames):
            frame = av.VideoFrame.from_ndarray(frame_fn(k, width, height), format="rgb24")
            frame.pts = k
            frame.time_base = Fraction(1, fps)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return codec


def write_audio_only(path: str | Path, seconds: float = 0.5, rate: int = 16000) -> None:
    """A file with one audio stream and no video stream."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("flac" if Path(path).suffix == ".mkv" else "aac", rate=rate)
        stream.layout = "mono"
        samples = int(seconds * rate)
        frame_size = stream.codec_context.frame_size or 1024
        fmt = stream.codec_context.format.name
        pts = 0
        while pts < samples:
            data = np.zeros((1, frame_size), dtype=np.int16 if fmt.startswith("s16") else np.float32)
            frame = av.AudioFrame.from_ndarray(data, format=fmt, layout="mono")
            frame.sample_rate, frame.pts = rate, pts
            out.mux(stream.encode(frame))
            pts += frame_size
        out.mux(stream.encode(None))


def write_garbage(path: str | Path, size: int = 4096, seed: int = 0) -> None:
    Path(path).write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())


def truncate(path: str | Path, fraction: float) -> None:
    """Cut a file to ``fraction`` of its bytes (a download or copy that stopped half-way)."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: int(len(data) * fraction)])
