#!/usr/bin/env bash
# The runs on the GPU Slurm cluster behind docs/benchmarks.md's multi-node rows, on a machine with several GPUs
# (as root). Starts the cluster (tests/slurm_testbed.py --real-gpus; from the .deb files in $SLURM_DEBS where
# Slurm is not installed), or keeps the one already up, then runs the named parts:
#
#   bash bench/gpu_cluster_run.sh OUTDIR PART...     PART: cluster | scaling | engines | tests | faults | slowrank
#
# cluster: the nodes get their own GPUs (one test); scaling: bench/slurm_scaling.py over 1x1 1x2 2x1 2xG;
# engines: ZeRO-1/2/3 at the largest shape; tests / faults: tests/test_gpu_cluster.py, without / with the
# faults (as many at once as a node has GPUs; FAULTS="killed or timed" picks some, as pytest's -k);
# slowrank: bench/slow_rank_faults.py through Slurm on 2 nodes (SLOW="host,data" picks faults; synthetic clips,
# or DATA=a prepared folder, as `bench/e2e_throughput.py --sources ''` leaves in its --work; LOG_EVERY=steps per
# log window; HOST_CYCLE / DATA_CYCLE="STOPPED,RUNNING" seconds and GPU_EXTRA_S=seconds size the faults).
# Wheels missing from the machine's Python may be carried in .whl/ (installed into /tmp/site). MPS=1 (nodes
# sharing a GPU) starts CUDA's Multi-Process Service first, so their kernels run side by side on the GPU rather
# than in turns: a rank's device time then no longer stretches while another rank's collective spins.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; shift; mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0   # DeepSpeed's op builder cannot parse "9.0a"
if [[ -d .whl && ! -e /tmp/site/.done ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done
fi
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
bed=${GPU_CLUSTER_DIR:-/tmp/taehv-gpu-cluster}
# NODES=3 for the spare-node tests; with fewer GPUs than nodes the nodes take turns on them (slurm_testbed_gpus.py)
nodes=${NODES:-2}; gpus=$(ls /dev | grep -cE '^nvidia[0-9]+$'); per_node=$(( gpus >= nodes ? gpus / nodes : 1 ))
if [[ ${MPS:-0} == 1 ]]; then  # default pipe folder /tmp/nvidia-mps: every node's tasks (root) find it
  nvidia-cuda-mps-control -d || exit 1
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  # a device spin of about 1 s alone, then in two processes at once: about 1 s with MPS, 2 s taking turns
  python3 - <<'PY' 2>&1 | tee -a "$out/cluster.log"
import subprocess, sys, time
spin = ("import torch; torch.cuda.init(); torch.cuda._sleep(1); torch.cuda.synchronize(); print(flush=True); "
        "input(); torch.cuda._sleep(int(1.9e9)); torch.cuda.synchronize()")
for n in (1, 2, 1):
    ps = [subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
          for _ in range(n)]
    for p in ps: p.stdout.readline()
    t = time.perf_counter()
    for p in ps: p.stdin.write("\n"); p.stdin.flush()
    for p in ps: p.wait()
    print(f"MPS check: {n} process(es) spinning at once took {time.perf_counter() - t:.2f} s")
PY
  echo get_server_list | nvidia-cuda-mps-control | sed 's/^/MPS server: /' | tee -a "$out/cluster.log"
fi
debs=(); command -v slurmctld >/dev/null || debs=(--slurm-debs "${SLURM_DEBS:-.slurm-debs}")
started=$(date +%s)
python3 -m tests.slurm_testbed start --dir "$bed" --nodes "$nodes" --real-gpus --no-accounting "${debs[@]}" \
  2>&1 | tee -a "$out/cluster.log" || exit 1
. "$bed/env.sh"; export TAEHV_GPU_CLUSTER=$bed TAEHV_GPU_CLUSTER_NODES=$nodes
nvidia-smi -L >> "$out/cluster.log"; echo "cluster up after $(( $(date +%s) - started )) s; $gpus GPUs, $nodes nodes, $per_node per node" | tee -a "$out/cluster.log"
tests() { timeout "${LIMIT:-500}" python3 -m pytest -o addopts= -m gpu_cluster -q -s -p no:cacheprovider -rA \
            tests/test_gpu_cluster.py "$@" 2>&1 | tee -a "$out/tests.log" | tail -40; }
for part in "$@"; do
  echo "=== $part ($(( $(date +%s) - started )) s)"
  case $part in
    cluster) tests -k own_share ;;
    scaling) timeout "${LIMIT:-450}" python3 bench/slurm_scaling.py --shapes "${SHAPES:-1x1,1x$per_node,2x1,2x$per_node}" \
               --out "$out/" 2>&1 | tee "$out/scaling.log" | grep -v Warning | tail -25 ;;
    engines) timeout "${LIMIT:-400}" python3 bench/slurm_scaling.py --shapes "2x$per_node" --skip-shapes \
               --engines zero1,zero2,zero3 --out "$out/" 2>&1 | tee "$out/engines.log" | tail -12 ;;
    tests) tests -k "not own_share and not fault" ;;
    faults) tests -k "${FAULTS:-fault}" -n "${FAULT_JOBS:-$per_node}" ;;   # a fault run takes 1 GPU of a node: per_node at once
    slowrank) timeout "${LIMIT:-540}" python3 bench/slow_rank_faults.py --cluster configs/cluster/gpu_testbed.yaml \
               --nodes 2 --gpus "$per_node" --cpus $(( $(nproc) / nodes / per_node < 14 ? $(nproc) / nodes / per_node : 14 )) \
               ${DATA:+--data "$DATA"} $([[ -n ${DATA:-} ]] || echo --synthetic) ${LOG_EVERY:+--log-every "$LOG_EVERY"} \
               ${GPU_EXTRA_S:+--gpu-extra-s "$GPU_EXTRA_S"} ${HOST_CYCLE:+--host-cycle "$HOST_CYCLE"} \
               ${DATA_CYCLE:+--data-cycle "$DATA_CYCLE"} --faults "${SLOW:-host,data,GPU,none}" --fault-step "${FAULT_STEP:-30}" \
               --fault-s "${FAULT_S:-60}" --timeout 300 --work /tmp/taehv-slow-rank --out "$out/" 2>&1 \
               | tee "$out/slowrank.log" | grep -v Warning | tail -12 ;;
  esac
done
# the rank logs and Slurm's own, for what the figures do not show
tar czf "$out/logs.tgz" --ignore-failed-read --exclude=checkpoints --exclude=compile-cache --exclude='*.pt' \
  -C / "${bed#/}/log" tmp/taehv-slurm-scaling/runs tmp/pytest-of-root tmp/taehv-slow-rank 2>/dev/null
echo "done after $(( $(date +%s) - started )) s"
