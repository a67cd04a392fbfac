"""TAEHV's compression, shared by the student, the 1 + 4k teachers and the prepared shards (no torch here:
`taehv prepare --dry-run` counts with it): 4 frames per latent in time, 8× in each spatial direction."""

from __future__ import annotations

TIME_FACTOR = 4
SPATIAL_FACTOR = 8


def teacher_frame_count(frames: int) -> int:
    """How many leading frames of a 4L-frame window the 1 + 4k teacher encodes into L latents."""
    if frames % TIME_FACTOR:
        raise ValueError(f"clip length {frames} is not a multiple of {TIME_FACTOR}")
    return frames - (TIME_FACTOR - 1)
