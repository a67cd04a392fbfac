"""Videos for tests: bench/videos.py is their home (the benchmarks write them too, and bench/ never
imports tests/); tests may import them from here."""

from bench.videos import (  # noqa: F401
    CODEC_CHOICES,
    COLOR_STEP,
    CYCLE,
    can_write,
    frame_color,
    nearest_frame,
    noisy_frame,
    pick_codec,
    solid_frame,
    thirds_frame,
    truncate,
    write_audio_only,
    write_garbage,
    write_video,
)
