"""The Triton kernel of `layers.relu_bias_grad`: ReLU's gradient and the bias gradient in one pass.

Imported only where it runs: on a CUDA GPU, or on CPU under ``TRITON_INTERPRET=1`` (tests).

A channels-last activation of C channels is an (M pixels × C) matrix. Each program takes one tile of whole
rows: it reads the incoming gradient and the ReLU's output, stores the masked gradient and its per-channel
sum; the tiles' sums are added in PyTorch (deterministic, no atomics). Compiled, the same work took a
masking kernel and a separate reduction that read the masked gradient again. Tile and warps: the fastest
of a sweep on an H200 at the shipped config's shapes, where one tile per program beat programs that loop
over several (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 16384  # elements (rows × channels) per program
WARPS = 4


@triton.jit
def _relu_bias_grad(grad_ptr, out_ptr, g_ptr, sums_ptr, M, C: tl.constexpr, ROWS: tl.constexpr):
    tile = tl.program_id(0)
    rows = tile * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, C)
    at = rows.to(tl.int64)[:, None] * C + c[None, :]
    ok = (rows < M)[:, None] & (c[None, :] < C)
    grad = tl.load(grad_ptr + at, mask=ok, other=0.0)
    out = tl.load(out_ptr + at, mask=ok, other=0.0)
    g = tl.where(out <= 0, tl.zeros_like(grad), grad)  # aten's threshold_backward, NaN included
    tl.store(g_ptr + at, g, mask=ok)
    tl.store(sums_ptr + tile * C + c, tl.sum(g.to(tl.float32), axis=0))


def relu_bias_grad(grad: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad where out > 0, else 0; its sum over batch and pixels) for channels-last (N, C, H, W) tensors
    with C a power of two. The sum is accumulated in fp32 and returned in ``out``'s dtype."""
    n, c, h, w = out.shape
    m = n * h * w
    g = torch.empty_like(out)  # channels-last like `out`
    rows = max(1, TILE // c)
    tiles = triton.cdiv(m, rows)
    sums = torch.empty(tiles, c, dtype=torch.float32, device=out.device)
    _relu_bias_grad[(tiles,)](grad, out, g, sums, m, C=c, ROWS=rows, num_warps=WARPS)
    return g, sums.sum(0).to(out.dtype)
