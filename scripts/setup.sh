#!/usr/bin/env bash
# Set up a fresh Debian 12 machine (run as root): Slurm, munge and MariaDB for the local test cluster,
# then the Python packages. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends slurm-wlm munge slurmdbd mariadb-server mariadb-client util-linux procps
id -u taehvtest >/dev/null 2>&1 || useradd -m taehvtest  # unprivileged user for tests/test_security_*.py

# torch first, pinned: 2.13.0 is a CPU wheel on these machines; anything unpinned pulls a CUDA build.
$PY -m pip install --upgrade pip setuptools wheel
$PY -m pip install torch==2.13.0
# deepspeed ships as an sdist: build it against the torch above, not in an isolated env (that pulls CUDA torch).
DS_BUILD_OPS=0 $PY -m pip install --no-build-isolation 'deepspeed>=0.19,<0.20'
$PY -m pip install --no-build-isolation -e '.[dev,deepspeed,trackers]'
# Triton, for its CPU interpreter in tests/test_rgb_head.py only: kept apart from site-packages (CPU torch
# brings no Triton, and with it installed every process that imports torch._dynamo imports it too).
$PY -m pip install --upgrade --target .triton-interpreter 'triton>=3.2'
$PY -m ipykernel install --sys-prefix --name python3 >/dev/null
echo "setup done: run the tests with  $PY -m pytest -q"
