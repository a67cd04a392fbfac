"""Triton kernels of the RGB head on the phase layout; `rgb_head.py` makes them one differentiable op.

Imported only where they run: on a CUDA GPU, or on CPU under ``TRITON_INTERPRET=1`` (tests).

The input is the last decoder stage's conv output with K frames stacked on the channels: frame ``n·K + k``
is channels ``k·C … (k+1)·C − 1`` of stacked image ``n``. Each kernel reads it in place (no copy into
frames), applies the ReLU as it loads, and runs the head's 3×3 conv (C → at most 16 outputs):
- forward: each program walks down ROWS output rows of one column block, reading each input row once and
  adding it to the three output rows it touches; (row, channel block) is one loop, so Triton pipelines its
  loads;
- backward: each program owns a block of input pixels and channels. It gathers the 9 shifted copies of
  the output gradient as one (pixels × 9·out) tile, so the input gradient (times the ReLU mask) and the
  weight gradient are each one matrix product per row. Weight gradients are summed over programs in
  PyTorch (deterministic, no atomics).
Block sizes: the fastest of a sweep on an H200 at the shipped config's shape (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

OUTS = 16  # output channels padded to a power of two (Triton's block sizes; the head has 3·up² = 12)
FORWARD_ROWS, FORWARD_COLS, FORWARD_CHANNELS, FORWARD_WARPS, FORWARD_STAGES = 16, 128, 64, 8, 2
BACKWARD_COLS, BACKWARD_CHANNELS, BACKWARD_WARPS, BACKWARD_STAGES = 64, 128, 8, 1
BACKWARD_PROGRAMS = 1024  # at least this many (several per SM), else split the rows too


@triton.jit
def _forward(y_ptr, w_ptr, b_ptr, out_ptr, H, W, sy_n, sy_c, sy_h, sy_w,
             K: tl.constexpr, CIN: tl.constexpr, COUT: tl.constexpr,
             ROWS: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr, OUTS: tl.constexpr):
    frame = tl.program_id(0)
    r0 = tl.program_id(1) * ROWS
    cols = tl.program_id(2) * BW + tl.arange(0, BW)
    o = tl.arange(0, OUTS)
    y_base = y_ptr + (frame // K).to(tl.int64) * sy_n + (frame % K) * CIN * sy_c
    out_base = out_ptr + frame.to(tl.int64) * COUT * H * W
    bias = tl.load(b_ptr + o)
    zero = tl.zeros((BW, OUTS), dtype=tl.float32)
    above = zero  # output row i - 1
    here = zero  # output row i
    below = zero  # output row i + 1
    for step in range((ROWS + 2) * (CIN // BC)):  # (input row, channel block): one loop to pipeline
        i = r0 - 1 + step // (CIN // BC)
        ch = (step % (CIN // BC)) * BC + tl.arange(0, BC)
        row = i + tl.zeros_like(cols)  # vectors, not scalars, in masks (Triton's interpreter)
        for dx in tl.static_range(3):
            src = cols + (dx - 1)
            ok = (src >= 0) & (src < W) & (row >= 0) & (row < H)
            x = tl.load(y_base + i * sy_h + src[:, None] * sy_w + ch[None, :] * sy_c,
                        mask=ok[:, None] & (ch[None, :] < CIN), other=0.0)
            x = tl.maximum(x, tl.zeros_like(x)).to(y_ptr.dtype.element_ty)  # the ReLU before the head
            for dy in tl.static_range(3):
                w = tl.load(w_ptr + ((dy * 3 + dx) * CIN + ch[:, None]) * OUTS + o[None, :])
                part = tl.dot(x, w)
                if dy == 0:
                    below += part
                elif dy == 1:
                    here += part
                else:
                    above += part
        last = (step % (CIN // BC) + tl.zeros_like(cols)) == (CIN // BC - 1)  # row i - 1 is complete
        keep = last & (row - 1 >= r0) & (row - 1 >= 0) & (row - 1 < H) & (cols < W)
        value = (above + bias[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_base + o[None, :] * (H * W) + (row[:, None] - 1) * W + cols[:, None], value,
                 mask=keep[:, None] & (o[None, :] < COUT))
        above = tl.where(last[:, None], here, above)
        here = tl.where(last[:, None], below, here)
        below = tl.where(last[:, None], zero, below)


@triton.jit
def _backward(g_ptr, y_ptr, w_ptr, gy_ptr, gw_ptr, H, W, sg_f, sg_c, sg_h, sg_w, sy_n, sy_c, sy_h, sy_w,
              rows, K: tl.constexpr, CIN: tl.constexpr, COUT: tl.constexpr, BW: tl.constexpr,
              BC: tl.constexpr, JO: tl.constexpr, OUTS: tl.constexpr):
    frame = tl.program_id(0)
    row_block = tl.program_id(1)
    col_blocks = tl.cdiv(W, BW)
    col_block = tl.program_id(2) % col_blocks
    cols = col_block * BW + tl.arange(0, BW)
    ch = (tl.program_id(2) // col_blocks) * BC + tl.arange(0, BC)
    j = tl.arange(0, JO)  # column of the gathered gradient: (tap, output channel), 9·COUT of them used
    tap, o = j // COUT, j % COUT
    ty, tx = tap // 3, tap % 3
    tap_ok = tap < 9
    # wt[(tap, o), c] = weight of input channel c in output o at that tap
    wt = tl.load(w_ptr + (tap[:, None] * CIN + ch[None, :]) * OUTS + o[:, None],
                 mask=tap_ok[:, None] & (ch[None, :] < CIN), other=0.0)
    y_off = (frame // K).to(tl.int64) * sy_n + (frame % K) * CIN * sy_c
    g_base = g_ptr + frame.to(tl.int64) * sg_f
    gw = tl.zeros((BC, JO), dtype=tl.float32)
    for i in range(row_block * rows, row_block * rows + rows):  # input rows
        # input pixel (i, c) feeds output (i - dy + 1, c - dx + 1) through tap (dy, dx)
        g_rows = i - ty[None, :] + 1
        g_cols = cols[:, None] - tx[None, :] + 1
        y_ok = (cols[:, None] < W) & (i + tl.zeros_like(ch)[None, :] < H)
        ok = tap_ok[None, :] & (g_rows >= 0) & (g_rows < H) & (g_cols >= 0) & (g_cols < W)
        g9 = tl.load(g_base + o[None, :] * sg_c + g_rows * sg_h + g_cols * sg_w, mask=ok, other=0.0)
        y_at = y_off + i * sy_h + cols[:, None] * sy_w + ch[None, :] * sy_c
        y = tl.load(y_ptr + y_at, mask=y_ok, other=0.0)
        gx = tl.dot(g9, wt)
        gy = tl.where(y > 0, gx, tl.zeros_like(gx))  # the ReLU's gradient
        tl.store(gy_ptr + y_at, gy.to(gy_ptr.dtype.element_ty), mask=y_ok)
        gw += tl.dot(tl.trans(tl.maximum(y, tl.zeros_like(y)).to(y_ptr.dtype.element_ty)), g9)
    program = (frame * tl.num_programs(1) + row_block) * col_blocks + col_block
    tl.store(gw_ptr + (program.to(tl.int64) * CIN + ch[:, None]) * JO + j[None, :], gw)


def _channel_block(cin: int, block: int) -> int:
    while cin % block:
        block //= 2
    return block


def _padded_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(out, in, 3, 3) → (tap, in, OUTS), zero beyond the real outputs."""
    cout, cin = weight.shape[:2]
    padded = weight.new_zeros(9, cin, OUTS, dtype=dtype)
    padded[:, :, :cout] = weight.permute(2, 3, 1, 0).reshape(9, cin, cout)
    return padded


def forward(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, frames: int) -> torch.Tensor:
    n, kc, h, w = y.shape
    cout, cin = weight.shape[:2]
    out = torch.empty(n * frames, cout, h, w, dtype=y.dtype, device=y.device)
    b = bias.new_zeros(OUTS, dtype=torch.float32)
    b[:cout] = bias
    grid = (n * frames, triton.cdiv(h, FORWARD_ROWS), triton.cdiv(w, FORWARD_COLS))
    _forward[grid](y, _padded_weight(weight, y.dtype), b, out, h, w, *y.stride(), K=frames, CIN=cin,
                   COUT=cout, ROWS=FORWARD_ROWS, BW=FORWARD_COLS, BC=_channel_block(cin, FORWARD_CHANNELS),
                   OUTS=OUTS, num_warps=FORWARD_WARPS, num_stages=FORWARD_STAGES)
    return out


def backward(grad: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
             frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, kc, h, w = y.shape
    cout, cin = weight.shape[:2]
    bc = _channel_block(cin, BACKWARD_CHANNELS)
    col_blocks = triton.cdiv(w, BACKWARD_COLS)
    row_blocks = min(h, triton.cdiv(BACKWARD_PROGRAMS, n * frames * col_blocks * (cin // bc)))
    rows = triton.cdiv(h, row_blocks)
    row_blocks = triton.cdiv(h, rows)
    grad = grad.to(y.dtype)  # the kernel's matrix products take one dtype
    grad_y = y.new_empty_strided(y.shape, y.stride())  # the kernel indexes both with y's strides
    jo = triton.next_power_of_2(9 * cout)
    partial = torch.empty(n * frames * row_blocks * col_blocks, cin, jo, dtype=torch.float32, device=y.device)
    grid = (n * frames, row_blocks, col_blocks * (cin // bc))
    _backward[grid](grad, y, _padded_weight(weight, y.dtype), grad_y, partial, h, w, *grad.stride(),
                    *y.stride(), rows, K=frames, CIN=cin, COUT=cout, BW=BACKWARD_COLS, BC=bc,
                    JO=jo, OUTS=OUTS, num_warps=BACKWARD_WARPS, num_stages=BACKWARD_STAGES)
    gw = partial.sum(0)[:, :9 * cout].reshape(cin, 9, cout)  # (in, tap, out)
    return grad_y, gw.permute(2, 0, 1).reshape(cout, cin, 3, 3).contiguous()
