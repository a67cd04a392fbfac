#!/usr/bin/env bash
# scripts/setup.sh timed on a bare Debian 12: a clean root filesystem (debootstrap minbase), a clone of this
# checkout in it, setup.sh run there in a chroot (apt and pip downloads included), then everything removed.
#
#   sudo bash bench/setup_bare_debian.sh [ROOT]     # ROOT default /tmp/debian12-setup; needs debootstrap, git
#
# TORCH_WHEEL=FILE: a local torch CPU wheel, offered to pip (as a site's mirror would) instead of PyTorch's
# CPU index; PIP_CERT=FILE: the CA bundle pip needs where a proxy sits between this machine and PyPI. Prints
# the seconds and setup.sh's output; no daemon is started in the chroot (policy-rc.d).
set -uo pipefail
R=${1:-/tmp/debian12-setup}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cleanup() {
    for m in dev/pts dev sys proc; do mountpoint -q "$R/$m" && umount -l "$R/$m"; done
    if mount | grep -q " $R/"; then echo "still mounted under $R: left in place"; else rm -rf "$R"; fi
}
trap cleanup EXIT
rm -rf "$R"
began=$SECONDS
debootstrap --variant=minbase bookworm "$R" http://deb.debian.org/debian >/dev/null || exit 1
echo "debootstrap: $((SECONDS - began)) s"
mount -t proc proc "$R/proc"; mount -t sysfs sys "$R/sys"; mount --bind /dev "$R/dev"; mount --bind /dev/pts "$R/dev/pts"
cp /etc/resolv.conf "$R/etc/resolv.conf"
printf '#!/bin/sh\nexit 101\n' > "$R/usr/sbin/policy-rc.d"; chmod +x "$R/usr/sbin/policy-rc.d"
git clone -q "$REPO" "$R/root/taehv-slurm"
env=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)
if [ -n "${TORCH_WHEEL:-}" ]; then mkdir -p "$R/wheels"; cp "$TORCH_WHEEL" "$R/wheels/"; env+=(PIP_FIND_LINKS=/wheels); fi
if [ -n "${PIP_CERT:-}" ]; then cp "$PIP_CERT" "$R/etc/pip-ca.crt"; env+=(PIP_CERT=/etc/pip-ca.crt); fi
began=$SECONDS
chroot "$R" /usr/bin/env -i "${env[@]}" bash -c 'cd /root/taehv-slurm && bash scripts/setup.sh'
echo "scripts/setup.sh: exit $?, $((SECONDS - began)) s"
chroot "$R" /usr/bin/env -i "${env[@]}" bash -c 'cd /root/taehv-slurm && . .venv/bin/activate &&
    python3 -c "import torch, deepspeed, taehv_slurm; print(\"torch\", torch.__version__, \"deepspeed\", deepspeed.__version__)" &&
    taehv submit --local --train configs/train/tiny.yaml --dry-run | tail -1'
