"""Triton kernels of the encoder's first convolution (`first_conv.py` makes them one differentiable op).

Imported only where they run: on a CUDA GPU, or on CPU under ``TRITON_INTERPRET=1`` (tests).

The first stage's conv reads few channels (a frame pair, 6 → 8) and writes many (2 × 64) at full
resolution: as a matrix product its reduction is 9 · 8 = 72 long, which cuDNN's tiles fill badly (67
TFLOP/s on an H200, 2.3 ms a micro-batch for a 2.1 GB output that takes 0.5 ms to write). Here each
program takes BM output pixels (channels-last rows) and gathers their 3×3 neighbourhoods as two tiles, taps
0-7 (8·C_IN columns) and tap 8 (C_IN columns, padded to 16), so the conv is two matrix products; bias and
ReLU are applied before the one store.

The backward needs no input gradient (the input is the clip). One pass reads the output gradient and the
ReLU's output, masks the gradient, and accumulates the bias gradient and the weight gradient (the gathered
input tiles, transposed, times the masked gradient) in registers: the masked gradient is never stored.
Each program walks TILES tiles; the programs' partial sums are added in PyTorch (deterministic, no
atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows per tile and warps: the fastest of bench/first_conv_throughput.py's sweep on an H200 at the shipped
# config's shape (docs/benchmarks.md).
FORWARD_ROWS, FORWARD_WARPS = 128, 8
BACKWARD_ROWS, BACKWARD_WARPS = 128, 8
BACKWARD_PROGRAMS = 528  # 4 per SM of an H200 / H100; each walks its share of the tiles


@triton.jit
def _gather(x_ptr, rows, M, H, W, C_IN: tl.constexpr, TAP0: tl.constexpr, K: tl.constexpr,
            VALID: tl.constexpr):
    """(len(rows) × K) tile of the input around each output pixel: column k is tap TAP0 + k // C_IN (taps in
    row-major order of the 3×3 window), channel k % C_IN; columns ≥ VALID and taps outside the image are 0."""
    k = tl.arange(0, K)
    tap = TAP0 + k // C_IN
    c = k % C_IN
    col = rows % W
    t = rows // W
    row = t % H
    n = t // H
    y = row[:, None] + (tap // 3 - 1)[None, :]
    x = col[:, None] + (tap % 3 - 1)[None, :]
    ok = ((rows < M)[:, None] & (k < VALID)[None, :] & (y >= 0) & (y < H) & (x >= 0) & (x < W))
    at = ((n[:, None] * H + y) * W + x).to(tl.int64) * C_IN + c[None, :]
    return tl.load(x_ptr + at, mask=ok, other=0.0)


@triton.jit
def _first_conv_forward(x_ptr, w_main_ptr, w_last_ptr, b_ptr, out_ptr, M, H, W,
             C_IN: tl.constexpr, C_OUT: tl.constexpr, K_LAST: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    o = tl.arange(0, C_OUT)
    main = _gather(x_ptr, rows, M, H, W, C_IN, 0, 8 * C_IN, 8 * C_IN)
    last = _gather(x_ptr, rows, M, H, W, C_IN, 8, K_LAST, C_IN)
    w_main = tl.load(w_main_ptr + tl.arange(0, 8 * C_IN)[:, None] * C_OUT + o[None, :])
    w_last = tl.load(w_last_ptr + tl.arange(0, K_LAST)[:, None] * C_OUT + o[None, :])
    acc = tl.dot(main, w_main) + tl.dot(last, w_last)
    acc += tl.load(b_ptr + o).to(tl.float32)[None, :]
    out = tl.maximum(acc, tl.zeros_like(acc)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * C_OUT + o[None, :], out, mask=(rows < M)[:, None])


@triton.jit
def _first_conv_backward(grad_ptr, out_ptr, x_ptr, dw_main_ptr, dw_last_ptr, db_ptr, M, H, W, TILES,
              C_IN: tl.constexpr, C_OUT: tl.constexpr, K_LAST: tl.constexpr, BM: tl.constexpr):
    program = tl.program_id(0)
    o = tl.arange(0, C_OUT)
    dw_main = tl.zeros((8 * C_IN, C_OUT), dtype=tl.float32)
    dw_last = tl.zeros((K_LAST, C_OUT), dtype=tl.float32)
    db = tl.zeros((C_OUT,), dtype=tl.float32)
    for i in range(TILES):
        rows = (program * TILES + i) * BM + tl.arange(0, BM)
        at = rows.to(tl.int64)[:, None] * C_OUT + o[None, :]
        ok = (rows < M)[:, None] & (o[None, :] < C_OUT)
        grad = tl.load(grad_ptr + at, mask=ok, other=0.0)
        out = tl.load(out_ptr + at, mask=ok, other=0.0)
        g = tl.where(out <= 0, tl.zeros_like(grad), grad)  # aten's threshold_backward, NaN included
        db += tl.sum(g.to(tl.float32), axis=0)
        main = _gather(x_ptr, rows, M, H, W, C_IN, 0, 8 * C_IN, 8 * C_IN)
        last = _gather(x_ptr, rows, M, H, W, C_IN, 8, K_LAST, C_IN)
        dw_main += tl.dot(tl.trans(main), g)
        dw_last += tl.dot(tl.trans(last), g)
    k_main = tl.arange(0, 8 * C_IN)
    k_last = tl.arange(0, K_LAST)
    tl.store(dw_main_ptr + program * (8 * C_IN * C_OUT) + k_main[:, None] * C_OUT + o[None, :], dw_main)
    tl.store(dw_last_ptr + program * (K_LAST * C_OUT) + k_last[:, None] * C_OUT + o[None, :], dw_last)
    tl.store(db_ptr + program * C_OUT + o, db)


def last_tap_width(c_in: int) -> int:
    return max(16, c_in)  # Triton's matrix products take at least 16 along the reduction


def _weight_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C_OUT, C_IN, 3, 3) → taps 0-7 as (8·C_IN × C_OUT) and tap 8 as (K_LAST × C_OUT), zero rows padded."""
    c_out, c_in = weight.shape[:2]
    rows = weight.permute(2, 3, 1, 0).reshape(9 * c_in, c_out)  # row tap·C_IN + channel
    last = weight.new_zeros(last_tap_width(c_in), c_out)
    last[:c_in] = rows[8 * c_in:]
    return rows[: 8 * c_in].contiguous(), last


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """relu(conv3x3(x, weight, bias, padding=1)) for channels-last x (N, C_IN, H, W), C_IN and C_OUT powers
    of two; the result is channels-last in x's dtype."""
    n, c_in, h, w = x.shape
    c_out = weight.shape[0]
    m = n * h * w
    out = torch.empty(n, c_out, h, w, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    w_main, w_last = _weight_rows(weight.to(x.dtype))
    _first_conv_forward[(triton.cdiv(m, FORWARD_ROWS),)](
        x, w_main, w_last, bias, out, m, h, w, C_IN=c_in, C_OUT=c_out, K_LAST=last_tap_width(c_in),
        BM=FORWARD_ROWS, num_warps=FORWARD_WARPS)
    return out


def backward(grad: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight gradient (C_OUT, C_IN, 3, 3), bias gradient), both in float32, of `forward` given its output
    `out` and the gradient `grad` of the output (both channels-last)."""
    n, c_in, h, w = x.shape
    c_out = out.shape[1]
    m = n * h * w
    k_last = last_tap_width(c_in)
    tiles = triton.cdiv(m, BACKWARD_ROWS)
    programs = min(BACKWARD_PROGRAMS, tiles)
    per_program = triton.cdiv(tiles, programs)
    programs = triton.cdiv(tiles, per_program)
    dw_main = torch.empty(programs, 8 * c_in, c_out, device=x.device, dtype=torch.float32)
    dw_last = torch.empty(programs, k_last, c_out, device=x.device, dtype=torch.float32)
    db = torch.empty(programs, c_out, device=x.device, dtype=torch.float32)
    _first_conv_backward[(programs,)](grad, out, x, dw_main, dw_last, db, m, h, w, per_program, C_IN=c_in,
                                      C_OUT=c_out, K_LAST=k_last, BM=BACKWARD_ROWS, num_warps=BACKWARD_WARPS)
    rows = torch.cat((dw_main.sum(0), dw_last.sum(0)[:c_in]))  # (9·C_IN, C_OUT), row tap·C_IN + channel
    dw = rows.reshape(3, 3, c_in, c_out).permute(3, 2, 0, 1).contiguous()
    return dw, db.sum(0)
