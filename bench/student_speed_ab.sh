#!/usr/bin/env bash
# One GPU call's A/B of the student's fast paths (and the teacher's profile), most important first, each
# step bounded by `timeout`; everything under OUTDIR (logs, result JSON, traces, the runs' metrics).
# Usage: bash bench/student_speed_ab.sh OUTDIR
#   1. GPU tests of the first-conv kernels and the fused conv; the kernels isolated; the host-to-device
#      copy of one micro-batch of frames
#   2. `jobs.submit --local` with configs/train/taehv.yaml on prepared shards: all fast paths (cold), then
#      warm without copy_overlap (TAEHV_FAST_PATHS_OFF), then cold without copy_overlap and
#      triton_first_conv (the code before both)
#   3. the isolated step with and without triton_first_conv (the first with its profile and trace)
#   4. the teacher compiled (batch 2) with its profile and trace
#   5. the isolated step with cuDNN timing all its candidate algorithms (--cudnn-benchmark-limit 0)
set -uo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
began=$(date +%s)
step() {  # NAME LIMIT COMMAND...: output to OUTDIR/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name (t=$(( $(date +%s) - began )) s)"
  timeout "$limit" "$@" 2>&1 | grep -v -i warning | tee "$out/$name.log" | tail -12
  return "${PIPESTATUS[0]}"
}
e2e() {  # NAME OFF-LIST: the shipped config end to end on the shared work folder
  TAEHV_FAST_PATHS_OFF="$2${TAEHV_FAST_PATHS_OFF:+,$TAEHV_FAST_PATHS_OFF}" step "$1" 240 \
    python3 bench/e2e_throughput.py --sources prepared --videos 16 --steps 10 --warmup-steps 4 \
    --isolated-steps 0 --prepare-flags=--no-compile --work /tmp/e2e62 --out "$out/$1.json"
  cp "$(ls -td /tmp/e2e62/runs/e2e-prepared-*/ | head -1)metrics.jsonl" "$out/$1.metrics.jsonl" 2>/dev/null
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$out/gpu.txt"
step gpu_tests 120 python3 -m pytest -m gpu -n 0 -q -p no:cacheprovider tests/test_first_conv.py \
  tests/test_fused_conv.py || export TAEHV_FAST_PATHS_OFF=triton_first_conv  # kernels wrong: measure the rest
TRITON_CACHE_DIR=/tmp/triton-micro step first_conv 120 python3 bench/first_conv_throughput.py \
  --out "$out/first_conv_throughput.json"
step h2d 60 python3 -c "
import torch
x = torch.randint(0, 256, (4, 12, 3, 480, 720), dtype=torch.uint8).pin_memory()
for _ in range(3): x.to('cuda', non_blocking=True)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); a.record()
for _ in range(20): x.to('cuda', non_blocking=True)
b.record(); b.synchronize(); ms = a.elapsed_time(b) / 20
print(f'pinned H2D of one micro-batch of frames ({x.numel() / 1e6:.1f} MB): {ms:.2f} ms, {x.numel() / ms / 1e6:.1f} GB/s')"
e2e e2e_on_cold ""
e2e e2e_copy_off_warm copy_overlap
rm -rf /tmp/e2e62/runs/compile-cache  # cold: the earlier runs' compiled kernels gone too
e2e e2e_both_off_cold copy_overlap,triton_first_conv
TRITON_CACHE_DIR=/tmp/triton-iso step train_first_conv_on 200 python3 bench/train_throughput.py \
  --variants compile_cl_graphs --batch 4 --profile compile_cl:4 --trace "$out/trace_train_step.json.gz" \
  --out "$out/train_first_conv_on.json"
TRITON_CACHE_DIR=/tmp/triton-iso step train_first_conv_off 150 python3 bench/train_throughput.py \
  --variants compile_cl_graphs --batch 4 --fast pair_first_stage,pad_first_conv,pad_rgb_out,fold_linear,phase_head,fused_conv_relu,triton_head,triton_relu_grad \
  --out "$out/train_first_conv_off.json"
step teacher 150 python3 bench/prepare_throughput.py --modes compile --batches 2 --skip decode,read \
  --warmup 2 --iters 3 --profile compile:2 --trace "$out/trace_teacher.json.gz" --out "$out/teacher.json"
step train_cudnn_all 150 python3 bench/train_throughput.py --variants compile_cl_graphs --batch 4 \
  --cudnn-benchmark-limit 0 --out "$out/train_cudnn_all.json"
echo "=== done (t=$(( $(date +%s) - began )) s)"
