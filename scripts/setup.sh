#!/usr/bin/env bash
# Set up a fresh Debian 12 machine (run as root): Slurm, munge and MariaDB for the local test cluster,
# then the Python packages. Safe to run again.
#
# PYTHON (default python3) is the interpreter the packages go into. Debian's own python3 takes no pip
# installs (PEP 668, "externally managed"): there they go into a virtual environment, .venv in the checkout.
# The interpreter's pip, setuptools and wheel are kept unless they are too old to build this package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu  # PyPI's Linux torch is a CUDA build of several GB
export DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
began=$SECONDS
say() { echo "setup: $*"; }

packages=(slurm-wlm munge slurmdbd mariadb-server mariadb-client util-linux procps ca-certificates
          charliecloud-runtime debootstrap)
command -v "$PY" >/dev/null || packages+=(python3)
say "Slurm, munge, MariaDB (apt)"
apt-get -qq update
apt-get -qq install -y --no-install-recommends "${packages[@]}" >/dev/null
id -u taehvtest >/dev/null 2>&1 || useradd -m taehvtest  # unprivileged user for tests/test_security_*.py
# The container tests' image (tests/test_containers.py, Charliecloud's ch-run): Debian 12 without Slurm, with
# what a Python interpreter mounted from this machine links against; /etc/hosts for ch-run to fill.
if [ ! -e .container-image/etc/taehv-test-image ]; then
    say "a Debian 12 container image without Slurm (debootstrap, for the container tests)"
    rm -rf .container-image
    debootstrap --variant=minbase --include=python3,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libgomp1 \
        bookworm .container-image http://deb.debian.org/debian >/dev/null
    touch .container-image/etc/hosts .container-image/etc/taehv-test-image
fi

# PEP 668: pip may not install into this interpreter's own packages (outside a virtual environment).
if "$PY" -c 'import os, sys, sysconfig
sys.exit(sys.prefix != sys.base_prefix
         or not os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
    say "$PY is managed by Debian: the Python packages go into .venv"
    apt-get -qq install -y --no-install-recommends python3-venv >/dev/null
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    PY=.venv/bin/python
fi
pip() { "$PY" -m pip "$@"; }

# What an editable install of this package needs (pyproject.toml): pip ≥ 21.3 (PEP 660), setuptools ≥ 64,
# and wheel while setuptools is older than 70.1. Anything older is named and upgraded; the rest is kept.
outdated=$("$PY" - <<'EOF'
import importlib.metadata as md, re
def version(name):
    try:
        return tuple(int(n) for n in re.findall(r"\d+", md.version(name))[:2])
    except md.PackageNotFoundError:
        return None
pip, setuptools, wheel = version("pip"), version("setuptools"), version("wheel")
old = [name for name, ok in (("pip", pip and pip >= (21, 3)), ("setuptools", setuptools and setuptools >= (64, 0)),
                             ("wheel", wheel or (setuptools and setuptools >= (70, 1)))) if not ok]
print(" ".join(old))
EOF
)
if [ -n "$outdated" ]; then
    say "too old or missing to build this package: $outdated; upgrading them"
    pip install -q --upgrade $outdated
fi

if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])' 2>/dev/null)" = "$TORCH" ]; then
    say "torch $TORCH already installed: kept"
else
    # A CPU build that pip finds by itself (a local wheel, a site's index) is taken; else PyTorch's CPU index.
    found=$(pip install --dry-run --no-deps -q --report - "torch==$TORCH" 2>/dev/null \
            | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])' \
            2>/dev/null || true)
    say "torch $TORCH (CPU)"
    case "$found" in
        *+cpu) pip install -q "torch==$TORCH" ;;
        *) pip install -q "torch==$TORCH" --index-url "$TORCH_CPU_INDEX" ;;
    esac
fi
say "DeepSpeed, then this package with its dev, deepspeed and trackers extras"
# deepspeed ships as an sdist: build it against the torch above, not in an isolated env (that pulls CUDA torch).
DS_BUILD_OPS=0 pip install -q --no-build-isolation 'deepspeed>=0.19,<0.20'
pip install -q --no-build-isolation -e '.[dev,deepspeed,trackers]'
# Triton, for its CPU interpreter in tests/test_rgb_head.py only: kept apart from site-packages (CPU torch
# brings no Triton, and with it installed every process that imports torch._dynamo imports it too).
pip install -q --upgrade --target .triton-interpreter 'triton>=3.2'
"$PY" -m ipykernel install --sys-prefix --name python3 >/dev/null
if [ "$PY" = .venv/bin/python ]; then
    say "done in $((SECONDS - began)) s: activate the environment with  . .venv/bin/activate  (the taehv" \
        "command and python3 are then this one), and run the tests with  python3 -m pytest -q"
else
    say "done in $((SECONDS - began)) s: run the tests with  $PY -m pytest -q"
fi
