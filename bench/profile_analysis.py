"""What bounds the student's step and the teacher's call on one H200: figures from kept files, on CPU.

    python3 bench/profile_analysis.py [--out FILE]

The student: torch.profiler's trace of 3 isolated steps (one micro-batch of 4 each; compiled, no CUDA
graphs; `bench/train_throughput.py --variants compile_cl --batch 4 --profile compile_cl:4 --trace T`), read
from bench/results/: the kernels' time a step; cuDNN's convolutions (each kernel under an aten convolution
op, whose recorded shapes give its FLOPs by torch's formulas) by direction, and the 64-output-channel 3×3
convs at 24×240×360 among them; the rest by the op that launched it. The run's measured bf16 matmul rate
and training FLOPs per clip are those its profile file records. The teacher: the FLOPs of one 13×480×720
clip through HunyuanVideo's encoder in the form `Teacher.compile` compiles, counted by torch's
FlopCounterMode on the meta device (no weights, no GPU). Each against the speed in force (the result files
in INPUTS) and the goals in GOALS. Prints the figures; --out also writes them to a file.
"""

from __future__ import annotations

import argparse
import ast
import collections
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._record import RESULTS, code_version  # noqa: E402

INPUTS = {
    "trace": "trace_train_step_h200_2026-11-27_d93ee1d.json.gz",
    "profile": "profile_train_step_h200_2026-11-27_d93ee1d.txt",  # its info line: FLOPs a clip, matmul rate
    "student": "e2e_student_ab_h200_2026-12-05_663ddb8.json",  # through the user's command, in force
    "teacher": "prepare_e2e_h200_2026-11-27_ab8e44d.json",  # through `taehv prepare`, in force
}
# The speed goals on one H200, through the user's commands.
GOALS = {"student_clips_per_s": 70, "teacher_clips_per_s": 16, "warm_start_s": 15, "cold_start_s": 40}
CONV_OPS = ("aten::cudnn_convolution", "aten::cudnn_convolution_relu", "aten::cudnn_convolution_add_relu",
            "aten::convolution_backward")
BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4}
BATCH = 4  # the profiled micro-batch
TEACHER_CLIP = (13, 480, 720)  # the frames a 16-frame window gives the teacher (4L − 3), as prepare runs it


def conv_out(x: list[int], w: list[int], stride: list[int], padding: list[int],
             dilation: list[int]) -> list[int]:
    spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1
               for size, k, s, p, d in zip(x[2:], w[2:], stride, padding, dilation, strict=True)]
    return [x[0], w[0], *spatial]


def direction_flops(op: dict[str, Any]) -> tuple[dict[str, int], list[int]]:
    """{fprop|dgrad|wgrad: FLOPs} of one aten convolution op, from its recorded shapes; and its output's."""
    from torch.utils.flop_counter import conv_flop_count

    dims, given = op["args"]["Input Dims"], op["args"]["Concrete Inputs"]
    lists = [ast.literal_eval(v) for v in given if v.startswith("[")]  # [1, 1], [True, True, False]
    if op["name"] == "aten::convolution_backward":
        grad, x, w = dims[0], dims[1], dims[2]
        flops, mask = conv_flop_count(x, w, grad), lists[-1]
        return {"dgrad": flops * mask[0], "wgrad": flops * mask[1]}, grad
    x, w = dims[0], dims[1]
    if op["name"] == "aten::cudnn_convolution":  # (input, weight, padding, stride, dilation, …)
        padding, stride, dilation = lists[:3]
    else:  # _relu, _add_relu: (…, stride, padding, dilation, groups)
        stride, padding, dilation = lists[:3]
    out = conv_out(x, w, stride, padding, dilation)
    return {"fprop": conv_flop_count(x, w, out)}, out


def kernel_direction(name: str) -> str:
    lowered = name.lower()
    return next((d for d in ("fprop", "dgrad", "wgrad") if d in lowered), "other")


def tile(name: str) -> str:
    found = re.search(r"tilesize(\d+x\d+)x\d+|_(\d+x\d+)_\d+x\d+_nhwc|GemmShapeILi(\d+)ELi(\d+)E", name)
    return "x".join(g for g in found.groups() if g) if found else "none named"


def read_trace(path: Path) -> tuple[list[dict], dict[int, dict], int]:
    """(kernels, the cpu op that launched each by its External id, steps profiled)."""
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    ops = {e["args"]["External id"]: e for e in events
           if e.get("cat") == "cpu_op" and "External id" in e["args"]}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    steps = sum(1 for e in events
                if e.get("cat") == "user_annotation" and e["name"].startswith("Optimizer.step"))
    return kernels, ops, steps


def convolutions(kernels: list[dict], ops: dict[int, dict], steps: int) -> dict[str, Any]:
    """Time (ms a step) and FLOPs (a step) of cuDNN's convolutions by direction: all, and the 64-channel ones
    at 24×240×360 ("c64"), whose time is also given by tile."""
    time = {"all": collections.Counter(), "c64": collections.Counter()}
    flops = {"all": collections.Counter(), "c64": collections.Counter()}
    tiles: collections.Counter = collections.Counter()
    counted = set()
    for k in kernels:
        op = ops.get(k["args"].get("External id"))
        if op is None or op["name"] not in CONV_OPS:
            continue
        per_direction, out = direction_flops(op)
        groups = ["all", "c64"] if out[1:] == [64, 240, 360] and out[0] == 24 else ["all"]
        for g in groups:
            time[g][kernel_direction(k["name"])] += k["dur"] / 1e3 / steps
            if id(op) not in counted:
                flops[g].update({d: f / steps for d, f in per_direction.items()})
        if "c64" in groups:
            tiles[tile(k["name"])] += k["dur"] / 1e3 / steps
        counted.add(id(op))
    return {"time": time, "flops": flops, "tiles": tiles}


def rest(kernels: list[dict], ops: dict[int, dict], steps: int) -> dict[str, Any]:
    """Kernels outside cuDNN's convolutions (ms a step) by what launched them; the ReLU gradients' bytes."""
    time: collections.Counter = collections.Counter()
    inductor: collections.Counter = collections.Counter()
    relu_bytes, counted = 0.0, set()
    for k in kernels:
        op = ops.get(k["args"].get("External id"))
        name, ms = op["name"] if op else "(no op)", k["dur"] / 1e3 / steps
        if name in CONV_OPS:
            continue
        if name.startswith("triton_"):
            time["Inductor's kernels"] += ms
            inductor[re.sub(r"_\d+$", "", name)] += ms
        elif name == "taehv::relu_bias_grad":
            time["ReLU gradient (taehv::relu_bias_grad)"] += ms
            if id(op) not in counted:  # reads the gradient and the activation, writes the gradient: 3 passes
                dims, kind = op["args"]["Input Dims"][0], op["args"]["Input type"][0]
                relu_bytes += 3 * BYTES[kind] * numel(dims) / steps
        elif name.startswith("taehv::relu_conv3x3_frames"):
            time["RGB head (taehv::relu_conv3x3_frames, forward + backward)"] += ms
        else:
            time[name] += ms
        if op is not None:
            counted.add(id(op))
    return {"time": time, "inductor": inductor, "relu_bytes": relu_bytes}


def numel(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def teacher_flops() -> dict[str, float]:
    """FLOPs of one TEACHER_CLIP through HunyuanVideo's encoder as `Teacher.compile` compiles it, by op."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from taehv_slurm.trainer.hunyuan_encoder import EncoderSettings, HunyuanVideoEncoder

    with torch.device("meta"):
        encoder = HunyuanVideoEncoder(EncoderSettings()).to(torch.bfloat16)
    encoder.use_channels_last()
    clip = torch.empty(1, 3, *TEACHER_CLIP, device="meta", dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        encoder(clip.contiguous(memory_format=torch.channels_last_3d))
    return {str(op): float(n) for op, n in counter.get_flop_counts()["Global"].items()}


def in_force() -> dict[str, Any]:
    """The profiled run's info, and the speeds and starts in force (the student's and the teacher's files)."""
    info = json.loads(next(line for line in (RESULTS / INPUTS["profile"]).read_text().splitlines()
                           if line.startswith('{"date"')))
    student = json.loads((RESULTS / INPUTS["student"]).read_text())["runs"]
    teacher = json.loads((RESULTS / INPUTS["teacher"]).read_text())
    rates = [row["prepare_clips_per_s_after_first"] for call in teacher.values() for part in call.values()
             for row in part["rows"]]
    every_path = next(run for run in student.values() if not run["TAEHV_FAST_PATHS_OFF"])
    return {"info": info, "student": every_path["rows"][0]["clips_per_s"],
            "starts": {name: run["rows"][0]["first_step_s"] for name, run in student.items()},
            "teacher_rates": rates}


def convolution_lines(conv: dict[str, Any], total: float) -> list[str]:
    lines = []
    for group, label in (("all", "cuDNN's convolutions"),
                         ("c64", "of which the 64-output-channel 3×3 convs at 24×240×360 (the encoder's "
                                 "first stage, the decoder's last)")):
        time, flops = conv["time"][group], conv["flops"][group]
        ms, tflop = sum(time.values()), sum(flops.values()) / 1e12
        lines.append(f"{label}: {ms:.2f} ms, {tflop:.2f} TFLOP, {tflop / ms * 1e3:.0f} TFLOP/s, "
                     f"{100 * ms / total:.1f} % of the kernels' time")
        lines += [f"  {d}: {time[d]:.2f} ms, {flops[d] / 1e12:.2f} TFLOP, "
                  f"{flops[d] / 1e9 / time[d]:.0f} TFLOP/s" for d in ("fprop", "dgrad", "wgrad")]
        lines.append(f"  other kernels (workspace, split-K reductions): {time['other']:.2f} ms")
    tiles = ", ".join(f"{t} {ms:.2f} ms" for t, ms in conv["tiles"].most_common())
    return [*lines, f"  their tiles: {tiles}"]


def rest_lines(other: dict[str, Any]) -> list[str]:
    rest_ms = sum(other["time"].values())
    named = [(name, ms) for name, ms in other["time"].most_common() if ms >= 0.1]
    small = (f"{len(other['time']) - len(named)} other ops, under 0.1 ms each",
             rest_ms - sum(ms for _, ms in named))
    lines = [f"the rest, kernels outside cuDNN's convolutions: {rest_ms:.2f} ms"]
    for name, ms in [*named, small]:
        lines.append(f"  {name}: {ms:.2f} ms")
        if name.startswith("ReLU gradient"):
            lines.append(f"    {other['relu_bytes'] / 1e9:.2f} GB a step (3 passes of each activation), "
                         f"{other['relu_bytes'] / (ms / 1e3) / 1e12:.2f} TB/s")
        if name == "Inductor's kernels":
            cat = sum(v for k, v in other["inductor"].items() if "_cat_" in k)
            largest = ", ".join(f"{k} {v:.2f} ms" for k, v in other["inductor"].most_common(4))
            lines.append(f"    of which those whose fused ops include a concatenation (cat): {cat:.2f} ms; "
                         f"the largest: {largest}")
    return lines


def student_lines(force: dict[str, Any]) -> list[str]:
    kernels, ops, steps = read_trace(RESULTS / INPUTS["trace"])
    info, goal, now = force["info"], GOALS["student_clips_per_s"], force["student"]
    rate, step_tflop = info["bf16_matmul_tflops"], BATCH * info["train_tflop_per_clip"]
    total = sum(k["dur"] for k in kernels) / 1e3 / steps
    return [f"## student: one isolated step of a micro-batch of {BATCH}, per step over the trace's {steps}",
            f"kernels: {total:.2f} ms a step",
            f"training FLOPs (the trainer's count: 3 × the forward's): {step_tflop:.2f} TFLOP a step "
            f"({info['train_tflop_per_clip']:.3f} a clip); at the run's measured bf16 matmul rate, "
            f"{rate:.1f} TFLOP/s: {step_tflop / rate * 1e3:.2f} ms, "
            f"{BATCH / (step_tflop / rate):.1f} clips/s",
            *convolution_lines(convolutions(kernels, ops, steps), total),
            *rest_lines(rest(kernels, ops, steps)),
            "## student: the goal through the user's command",
            f"{goal} clips/s: {BATCH / goal * 1e3:.2f} ms a micro-batch of {BATCH}; in force {now:.2f} "
            f"clips/s ({INPUTS['student']}): {BATCH / now * 1e3:.2f} ms, "
            f"{(BATCH / now - BATCH / goal) * 1e3:.2f} ms above the goal's"]


def teacher_lines(force: dict[str, Any]) -> list[str]:
    counted = teacher_flops()
    tflop, rate = sum(counted.values()) / 1e12, force["info"]["bf16_matmul_tflops"]
    goal, low, high = GOALS["teacher_clips_per_s"], min(force["teacher_rates"]), max(force["teacher_rates"])
    by_op = ", ".join(f"{op} {n / 1e12:.3f}" for op, n in sorted(counted.items(), key=lambda x: -x[1]))
    return ["## teacher: HunyuanVideo's encoder as Teacher.compile compiles it",
            f"FLOPs of one {'×'.join(map(str, TEACHER_CLIP))} clip: {tflop:.2f} TFLOP ({by_op})",
            f"at the student run's measured bf16 matmul rate, {rate:.1f} TFLOP/s: "
            f"{tflop / rate * 1e3:.2f} ms a clip, {rate / tflop:.2f} clips/s",
            f"{goal} clips/s: {goal * tflop:.0f} TFLOP/s, "
            f"{100 * goal * tflop / rate:.1f} % of the matmul rate",
            f"in force ({INPUTS['teacher']}): {low:.2f}–{high:.2f} clips/s, "
            f"{low * tflop:.0f}–{high * tflop:.0f} TFLOP/s, "
            f"{100 * low * tflop / rate:.1f}–{100 * high * tflop / rate:.1f} % of the matmul rate"]


def start_lines(force: dict[str, Any]) -> list[str]:
    starts = ", ".join(f"{name} {s} s" for name, s in force["starts"].items())
    return ["## starts: job start → first training step",
            f"goals: warm ≤ {GOALS['warm_start_s']} s, cold ≤ {GOALS['cold_start_s']} s",
            f"in force ({INPUTS['student']}): {starts}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="also write the figures to this file")
    args = p.parse_args()
    version, force = code_version(), in_force()
    changes = " with uncommitted changes" if version.get("dirty") else ""
    head = (f"# bench/profile_analysis.py at commit {version.get('commit')}{changes}; "
            f"inputs in bench/results/: {', '.join(INPUTS.values())}")
    text = "\n".join([head, *student_lines(force), *teacher_lines(force), *start_lines(force)]) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
