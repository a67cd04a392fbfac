#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md's table, on one GPU (multi: 2 GPUs of one host; faults: all of them).
# Usage: bash bench/run_gpu_benchmarks.sh PART [OUTDIR]
#   PART: student | starts | start | quality | kernels | teacher | data | signal | watchers | gpu_tests (or tests) | multi |
#         faults | all; and, not in all (A/Bs): micro_batch, teacher_norm, teacher_norm_e2e, cudnn_all,
#         teacher_coordinate_descent, student_coordinate_descent
#   (OUTDIR: bench/results)
# Each run writes OUTDIR/<bench>_<gpu>_<date>_<commit>.json (bench/_record.py's scheme; <bench> names what
# was measured, e.g. e2e_start_warm) and its output beside it as .log; gpu_tests writes
# OUTDIR/gpu_tests_<gpu>_<date>_<commit>.txt: `pytest -m gpu` whole, its wall time, every test's outcome and
# duration.
# Wheels missing from the GPU image (deepspeed, submitit, av, diffusers, pytest-timeout, ...) may be carried in
# .whl/ (scripts/device_carry.sh fills it): installed into /tmp/site, as bench/gpu_cluster_run.sh does.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}; out=${2:-bench/results}; mkdir -p "$out"
[[ $part == tests ]] && part=gpu_tests
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1   # DeepSpeed's op builder cannot parse "9.0a"
if [[ -d .whl && ! -e /tmp/site/.done ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done
fi
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
gpus() { python3 -c "import torch; print(torch.cuda.device_count())"; }
# <gpu>_<date>_<commit> of this run, as bench/_record.py names its results
tag() { python3 -c "import datetime, sys, torch; from bench._record import code_version, result_name
print(result_name('', {'device': torch.cuda.get_device_name(0), 'date': datetime.date.today().isoformat(),
                       **code_version()}, gpus=int(sys.argv[1]), suffix='')[1:])" "${1:-1}"; }
run() {  # NAME GPUS COMMAND...: --out OUTDIR/NAME_<tag>.json is added unless NOJSON=1; output to NAME_<tag>.log
  local name=$1 n=$2; shift 2; local base; base="$out/${name}_$(tag "$n")"; echo "=== $name -> $base.*"
  [[ ${NOJSON:-0} == 1 ]] || set -- "$@" --out "$base.json"
  timeout "${LIMIT:-600}" "$@" 2>&1 | grep -v Warning | tee "$base.log" | tail -25
}
want() { [[ $part == "$1" || $part == all ]]; }
# the two isolated measurements the A/Bs repeat: the student's compiled step (batch 4), the teacher alone
student_step=(python3 bench/train_throughput.py --variants compile_cl_graphs --batch 4)
teacher_alone=(python3 bench/prepare_throughput.py --modes compile --batches 2 --skip decode,read)
if want student; then  # the isolated step, then the shipped config end to end
  run train_throughput 1 "${student_step[@]}"
  LIMIT=1500 run e2e_throughput 1 python3 bench/e2e_throughput.py --sources prepared --videos 24 --steps 16 \
    --warmup-steps 4 --work /tmp/taehv-e2e-student
fi
if [[ $part == micro_batch ]]; then  # the shipped micro-batch of 4 against 2: isolated, then through the command
  run train_step_micro_batch 1 python3 bench/train_throughput.py --variants compile_cl_graphs --batch 2,4
  for b in 2 4; do
    LIMIT=200 run "e2e_micro_batch_$b" 1 python3 bench/e2e_throughput.py --sources prepared --videos 16 --steps 20 \
      --warmup-steps 12 --isolated-steps 0 --prepare-flags=--no-compile --work /tmp/taehv-e2e-micro --set "batch.per_gpu=$b"
  done
fi
if [[ $part == teacher_norm ]]; then  # the teacher alone, its GroupNorms' statistics in one read or two, alternated
  for round in 1 2; do
    run "prepare_throughput_one_pass_norm_$round" 1 "${teacher_alone[@]}"
    TAEHV_FAST_PATHS_OFF=one_pass_norm run "prepare_throughput_two_pass_norm_$round" 1 "${teacher_alone[@]}"
  done
fi
if [[ $part == teacher_norm_e2e ]]; then  # the same A/B through `taehv prepare --local`: one pass, two, one again
  e2e=(python3 bench/prepare_e2e.py --videos 64 --work /tmp/taehv-prepare-e2e --variants)
  LIMIT=240 run prepare_e2e_one_pass_norm_1 1 "${e2e[@]}" defaults-cold,defaults-warm
  TAEHV_FAST_PATHS_OFF=one_pass_norm LIMIT=200 run prepare_e2e_two_pass_norm 1 "${e2e[@]}" defaults-cold,defaults-warm
  LIMIT=120 run prepare_e2e_one_pass_norm_2 1 "${e2e[@]}" defaults-warm
fi
if [[ $part == cudnn_all ]]; then  # the isolated step: cuDNN timing torch's default 10 candidates, then all
  for limit in 10 0; do
    run "train_step_cudnn_limit_$limit" 1 "${student_step[@]}" --cudnn-benchmark-limit "$limit"
  done
fi
# Inductor tuning each Triton kernel's block sizes (coordinate descent), or not; each on a compile cache of its own
if [[ $part == teacher_coordinate_descent ]]; then  # the teacher alone
  for cd in 0 1; do
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=$cd TORCHINDUCTOR_CACHE_DIR=/tmp/taehv-cd-$cd run \
      "prepare_throughput_coordinate_descent_$cd" 1 "${teacher_alone[@]}" --warmup 2 --iters 6
  done
fi
if [[ $part == student_coordinate_descent ]]; then  # the student's isolated step
  for cd in 0 1; do
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=$cd TORCHINDUCTOR_CACHE_DIR=/tmp/taehv-cd-$cd run \
      "train_step_coordinate_descent_$cd" 1 "${student_step[@]}"
  done
fi
if want starts; then  # the shipped config through the command: cold (compiled aside), warm; cold, in the rank
  python3 -c "import torch, deepspeed, taehv_slurm.trainer.train" 2>/dev/null  # both colds find the files read
  w=/tmp/taehv-e2e-start  # one work folder, so one job folder and compile cache: the second run is warm
  e2e=(python3 bench/e2e_throughput.py --sources prepared --videos 16 --steps 20 --warmup-steps 12 --isolated-steps 0
       --prepare-flags=--no-compile --work "$w")
  LIMIT=300 run e2e_start_cold 1 "${e2e[@]}"
  LIMIT=150 run e2e_start_warm 1 "${e2e[@]}"
  rm -rf "$w/runs/compile-cache"
  TAEHV_FAST_PATHS_OFF=compile_aside LIMIT=200 run e2e_start_cold_in_rank 1 "${e2e[@]}"
fi
if want start; then  # start to first step isolated, as a rank starts: cold, then warm twice, with the timeline
  run compile_start 1 python3 bench/compile_start.py --starts 3
fi
if want quality; then  # the first 200 steps as shipped (twice) and with every fast path off; exported PSNR
  LIMIT=${LIMIT:-900} run fast_paths_quality 1 python3 bench/fast_paths_quality.py
fi
if want kernels; then
  run rgb_head_throughput 1 python3 bench/rgb_head_throughput.py --sweep
  run relu_grad_throughput 1 python3 bench/relu_grad_throughput.py --sweep
fi
if want teacher; then  # the teacher alone, then `taehv prepare --local` cold and warm on one compile cache
  run prepare_throughput 1 "${teacher_alone[@]}" --profile compile:2 --trace "$out/trace_teacher_$(tag 1).json.gz"
  for start in cold warm; do
    LIMIT=1500 run "prepare_e2e_$start" 1 python3 bench/prepare_e2e.py --videos 64 --work /tmp/taehv-prepare-e2e
  done
fi
if want data; then
  run loader_throughput 1 python3 bench/loader_throughput.py --workers 1,2,4,8,12 --seconds 6
  run decode_and_read 1 python3 bench/prepare_throughput.py --skip teacher
fi
if want signal; then
  run requeue_signal 1 python3 bench/requeue_signal.py --gpus 1 --resume-gpus 1 --steps 30 --signal-at 15
fi
if want watchers; then
  LIMIT=1500 run e2e_watchers_ab 1 python3 bench/e2e_throughput.py --sources prepared --watchers-ab 2
fi
if want gpu_tests; then  # pytest -m gpu whole, from an empty compile cache (a fresh machine's), timed
  file="$out/gpu_tests_$(tag 1).txt"; cache=$(mktemp -d /tmp/taehv-gpu-tests-XXXX)
  { echo "# python3 -m pytest -o addopts= -m gpu -q -rA --durations=0 -p no:cacheprovider (bash bench/run_gpu_benchmarks.sh gpu_tests)"
    echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); $(python3 -c 'import torch; print("torch", torch.__version__)')"
    echo "# code: $(git rev-parse --short HEAD)$([[ -n $(git status --porcelain --untracked-files=no) ]] && echo ' with uncommitted changes'); one compile cache for the whole run, empty at its start"
  } > "$file"
  began=$(date +%s.%N)
  TORCHINDUCTOR_CACHE_DIR=$cache/inductor timeout "${LIMIT:-590}" python3 -m pytest -o addopts= -m gpu -q -rA \
    --durations=0 -p no:cacheprovider 2>&1 | grep -v Warning >> "$file"
  status=${PIPESTATUS[0]}
  echo "# pytest -m gpu: exit $status, $(python3 -c "print(round($(date +%s.%N) - $began, 1))") s wall" >> "$file"
  tail -25 "$file"; echo "=== gpu_tests -> $file"
fi
if want faults && (( $(gpus) >= 2 )); then  # on every GPU: the watchers' cost, then each slow-rank fault named
  n=$(gpus)
  LIMIT=2400 run e2e_watchers_ab "$n" python3 bench/e2e_throughput.py --sources prepared --gpus "$n" \
    --watchers-ab 2 --work /tmp/taehv-e2e
  LIMIT=2400 run slow_rank_faults "$n" python3 bench/slow_rank_faults.py --data /tmp/taehv-e2e/prepared --gpus "$n"
fi
if want multi && (( $(gpus) >= 2 )); then
  run train_throughput 2 python3 bench/train_throughput.py --gpus 2 --engines allreduce \
    --multi-variant compile_cl_graphs --batch 4
  run engines 2 python3 bench/train_throughput.py --gpus 2 --engines allreduce,zero1,zero2,zero3 \
    --multi-variant eager_cl --batch 8
fi
