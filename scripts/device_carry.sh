#!/usr/bin/env bash
# Fill the two folders a lent GPU machine needs and lacks (see docs/contributing.md, "A Slurm cluster on real
# GPUs"): .whl/ (Python 3.12 wheels of what its image does not hold) and .slurm-debs/ (Debian 12's Slurm and
# munge packages). Both are ignored by git; pass them as the device run's carry. Run once per checkout, after
# scripts/setup.sh (the DeepSpeed wheel is built against the installed torch).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.slurm-debs/' .git/info/exclude 2>/dev/null || echo '/.slurm-debs/' >> .git/info/exclude
mkdir -p .whl .slurm-debs

# Not on the GPU image (python3.12, torch 2.11+cu130): our own needs, DeepSpeed's, the teacher's.
binary=(submitit==1.5.4 av==18.1.0 hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
        typing-inspection==0.4.2 diffusers==0.42.1 importlib-metadata==8.7.0 orjson==3.13.0)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${binary[@]}"
ls .whl/python_hostlist-*.whl >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps -w .whl python-hostlist==2.2.1
ls .whl/deepspeed-*.whl >/dev/null 2>&1 \
    || DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8

(cd .slurm-debs && apt-get download slurmd slurmctld slurm-client slurm-wlm-basic-plugins munge libmunge2 \
    libhwloc15 >/dev/null)
du -sh .whl .slurm-debs
