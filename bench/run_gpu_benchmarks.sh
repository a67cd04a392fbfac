#!/usr/bin/env bash
# The GPU benchmark session behind docs/benchmarks.md, on one host with 2 GPUs (nvidia-h200-x2).
# Usage: bash bench/run_gpu_benchmarks.sh PART OUTDIR   (PART: e2e | single | multi | signal | prepare | all)
# e2e needs one GPU only: the user's command end to end, the loader rates and the GPU tests (~25 min).
# Wheels missing from the GPU image (deepspeed, submitit, av, diffusers, ...) must already be importable.
set -uo pipefail
part=${1:-all}; out=${2:-bench/results}; mkdir -p "$out"
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1   # DeepSpeed's op builder cannot parse "9.0a"
run() { local name=$1; shift; echo "=== $name"; timeout "${LIMIT:-400}" "$@" 2>&1 | grep -v Warning | tee "$out/$name.log" | tail -25; }
if [[ $part == e2e || $part == all ]]; then
  LIMIT=1500 run e2e python3 bench/e2e_throughput.py --out "$out/e2e_throughput.json"
  run loader python3 bench/loader_throughput.py --workers 1,2,4,8,12 --seconds 6 --out "$out/loader_throughput.json"
  LIMIT=1500 run gpu_tests python3 -m pytest -m gpu -n 0 -q -s -p no:cacheprovider tests/test_gpu.py
fi
if [[ $part == single || $part == all ]]; then
  run single python3 bench/train_throughput.py --variants compile_cl --batch ${BATCH:-4,8} --profile compile_cl:4 --out "$out/train_single.json"
  run graphs python3 bench/train_throughput.py --variants compile_cl_graphs --batch 4 --out "$out/train_cuda_graphs.json"
  run single_plain python3 bench/train_throughput.py --variants eager,compile_cl --batch 4 --fast none --out "$out/train_single_plain.json"
  run engines_1gpu python3 bench/train_throughput.py --variants eager_cl --engines allreduce,zero2 --batch 4 --out "$out/engines_1gpu.json"
  LIMIT=900 run compile_start python3 bench/compile_start.py --ab --out "$out/compile_start.json"
fi
if [[ $part == multi || $part == all ]]; then
  run scaling python3 bench/train_throughput.py --gpus 2 --engines allreduce --multi-variant compile_cl_graphs --batch 4 --out "$out/train_2gpu.json"
  run engines python3 bench/train_throughput.py --gpus 2 --engines allreduce,zero1,zero2,zero3 --multi-variant eager_cl --batch 8 --out "$out/engines_2gpu.json"
fi
if [[ $part == signal || $part == all ]]; then
  run signal python3 bench/requeue_signal.py --gpus 2 --resume-gpus 1 --steps 30 --signal-at 15 --out "$out/requeue_signal.json"
fi
if [[ $part == prepare || $part == all ]]; then
  run prepare python3 bench/prepare_throughput.py --out "$out/prepare_throughput.json"
fi
