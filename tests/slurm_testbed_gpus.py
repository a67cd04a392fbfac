"""The testbed on a machine with real GPUs: each node gets its share of the host's GPUs through gres.

    python -m tests.slurm_testbed start --dir /tmp/gpucluster --nodes 2 --real-gpus \
        --slurm-debs .slurm-debs --no-accounting
    . /tmp/gpucluster/env.sh       # SLURM_CONF, and PATH / LD_LIBRARY_PATH for Slurm carried in as .deb files

What differs from the CPU testbed, and why:
- Slurm may come as Debian 12's packages unpacked under `<dir>/slurm` (`--slurm-debs`), for machines with no
  registry: `apt-get download slurmd slurmctld slurm-client slurm-wlm-basic-plugins munge libmunge2
  libhwloc15` (3.3 MB) where one is reachable, and carry the folder. Debian's postinst scripts, which do not
  run then, would have named the daemons without their `-wlm` suffix and put slurmstepd where slurmd looks for
  it: done here.
- Node i's gres.conf line names its own device files (/dev/nvidia2, /dev/nvidia3 for the second of two
  nodes on a 4-GPU host). Slurm sets CUDA_VISIBLE_DEVICES to the node-local indices (0,1 on every node) —
  right on a real cluster, where a node's GPUs are all its own, wrong here where the nodes share one host's
  numbering: a TaskProlog turns the local indices into the host's, as the device cgroup would on a real node.
- With fewer GPUs than nodes (`--nodes 3` on a 1-GPU host) the nodes share the GPUs in turn: every node still
  has its own hostname, so NCCL still connects them over sockets as separate hosts (it refuses two ranks on
  one GPU only within one host). Right for what crosses nodes (launch, NCCL between hosts, faults, restarts,
  spares), not for speed: the ranks time-slice one GPU (unless CUDA MPS runs: bench/gpu_cluster_run.sh MPS=1).
- slurmd needs a cgroup v1 freezer hierarchy (cgroup/v2 needs systemd's dbus, which such images lack):
  where none is mounted, one is mounted privately under `<dir>/cgroup` and named in cgroup.conf.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.testbed_processes import TestbedError

# The daemons as Debian's update-alternatives would name them (the packages ship only the -wlm names).
DAEMON_NAMES = {"slurmd": "slurmd-wlm", "slurmctld": "slurmctld-wlm", "slurmstepd": "slurmstepd-wlm"}
# slurmd starts each step's slurmstepd from this compiled-in path, not from PATH.
SLURMSTEPD = Path("/usr/sbin/slurmstepd")
LIB = "usr/lib/x86_64-linux-gnu"


def host_gpus() -> list[str]:
    """This host's NVIDIA GPU device files (/dev/nvidia0, /dev/nvidia1, ...), in index order."""
    found = [p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    return [str(p) for p in sorted(found, key=lambda p: int(p.name[6:]))]


def device_index(path: str) -> int:
    """The host's index of a GPU device file: /dev/nvidia3 → 3."""
    match = re.search(r"(\d+)$", path)
    if not match:
        raise TestbedError(f"Slurm testbed: {path} is not a GPU device file named like nvidiaN")
    return int(match.group(1))


def split_gpus(devices: Sequence[str], nodes: int) -> list[list[str]]:
    """Each node's device files: the host's GPUs in equal consecutive shares; with fewer GPUs than nodes,
    the nodes take turns (node i gets GPU i mod the count), so a 1-GPU host can hold a 3-node cluster."""
    if not devices or (len(devices) % nodes if len(devices) >= nodes else nodes % len(devices)):
        raise TestbedError(f"Slurm testbed: {len(devices)} GPU(s) on this host cannot be split evenly over "
                           f"{nodes} node(s): choose --nodes to divide the GPU count, or a multiple of it")
    if len(devices) < nodes:
        return [[devices[i % len(devices)]] for i in range(nodes)]
    share = len(devices) // nodes
    return [list(devices[i * share:(i + 1) * share]) for i in range(nodes)]


def shares_gpus(shares: Sequence[Sequence[str]]) -> bool:
    """Whether some GPU is given to more than one node (a host with fewer GPUs than nodes)."""
    files = [f for share in shares for f in share]
    return len(set(files)) < len(files)


def gres_lines(node_names: Sequence[str], shares: Sequence[Sequence[str]]) -> str:
    """gres.conf: one line per node naming its own device files (consecutive: /dev/nvidia[2-3])."""
    lines = []
    for name, files in zip(node_names, shares):
        first, last = device_index(files[0]), device_index(files[-1])
        stem = files[0][: -len(str(first))]
        numbers = str(first) if first == last else f"[{first}-{last}]"
        lines.append(f"NodeName={name} Name=gpu File={stem}{numbers}\n")
    return "".join(lines)


def task_prolog(node_names: Sequence[str], shares: Sequence[Sequence[str]]) -> str:
    """A TaskProlog that maps the node-local CUDA_VISIBLE_DEVICES Slurm sets to this host's indices."""
    cases = "\n".join(f"  {name}) map='{' '.join(str(device_index(f)) for f in files)}' ;;"
                      for name, files in zip(node_names, shares))
    return f"""#!/bin/sh
# Written by tests/slurm_testbed_gpus.py: Slurm numbers a node's GPUs from 0, the host from 0 over all nodes.
case "$(hostname)" in
{cases}
  *) exit 0 ;;
esac
[ -n "$CUDA_VISIBLE_DEVICES" ] || exit 0
set -- $map
out=""
for local in $(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' '); do
  eval "host=\\${{$((local + 1))}}"
  out="$out${{out:+,}}$host"
done
echo "export CUDA_VISIBLE_DEVICES=$out"
"""


# ------------------------------------------------------------------------ Slurm from .deb files


def unpack_slurm(debs: Path, prefix: Path) -> None:
    """Debian's Slurm and munge packages from the folder `debs`, unpacked under `prefix` (not `/`)."""
    files = sorted(Path(debs).glob("*.deb"))
    names = " ".join(f.name for f in files)
    missing = [p for p in ("slurmd_", "slurmctld_", "slurm-client_", "slurm-wlm-basic-plugins_", "munge_",
                           "libmunge2_") if p not in names]
    if missing:
        raise TestbedError(f"Slurm testbed: {debs} lacks {', '.join(m.rstrip('_') for m in missing)}: "
                           "fill it with `apt-get download slurmd slurmctld slurm-client "
                           "slurm-wlm-basic-plugins munge libmunge2 libhwloc15` on Debian 12")
    prefix.mkdir(parents=True, exist_ok=True)
    for deb in files:
        done = subprocess.run(["dpkg-deb", "-x", str(deb), str(prefix)], capture_output=True, text=True)
        if done.returncode != 0:
            raise TestbedError(f"Slurm testbed: unpacking {deb.name} failed: {done.stderr.strip()}")
    sbin = prefix / "usr/sbin"
    for name, real in DAEMON_NAMES.items():
        link = sbin / name
        if not link.exists():
            link.symlink_to(real)
    if not SLURMSTEPD.exists():
        SLURMSTEPD.symlink_to(sbin / DAEMON_NAMES["slurmstepd"])


def prefix_environ(prefix: Path, environ: dict[str, str]) -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH that find the Slurm and munge unpacked under `prefix` first."""
    lib = f"{prefix / LIB}:{prefix / LIB / 'slurm-wlm'}"
    old_lib = environ.get("LD_LIBRARY_PATH", "")
    path = environ.get("PATH", "/usr/bin:/bin")
    return {"PATH": f"{prefix / 'usr/bin'}:{prefix / 'usr/sbin'}:{path}",
            "LD_LIBRARY_PATH": f"{lib}:{old_lib}" if old_lib else lib}


def plugin_dir(prefix: Path) -> Path:
    return prefix / LIB / "slurm-wlm"


def ensure_munge_user() -> None:
    """munged runs as the user `munge`, which an image without Debian's postinst scripts lacks."""
    try:
        pwd.getpwnam("munge")
        return
    except KeyError:
        pass
    done = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                           "munge"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise TestbedError(f"Slurm testbed: cannot create the user munge: {done.stderr.strip()}")


# ---------------------------------------------------------------------------------- cgroup v1


def freezer_mounted() -> bool:
    """A cgroup v1 hierarchy with the freezer controller is mounted (slurmd's cgroup/v1 needs one)."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] == "cgroup" and "freezer" in fields[3].split(","):
            return True
    return False


def mount_private_freezer(mountpoint: Path) -> None:
    """A tmpfs at `mountpoint` with the v1 freezer controller mounted at `mountpoint`/freezer."""
    if (mountpoint / "freezer" / "tasks").exists():
        return
    mountpoint.mkdir(parents=True, exist_ok=True)
    for argv in (["mount", "-t", "tmpfs", "taehv_cgroup", str(mountpoint)],
                 ["mkdir", "-p", str(mountpoint / "freezer")],
                 ["mount", "-t", "cgroup", "-o", "freezer", "taehv_freezer", str(mountpoint / "freezer")]):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise TestbedError(f"Slurm testbed: `{' '.join(argv)}` failed ({done.stderr.strip()}): slurmd "
                               "needs a cgroup v1 freezer hierarchy")


def unmount_private_freezer(mountpoint: Path) -> None:
    for target in (mountpoint / "freezer", mountpoint):
        if os.path.ismount(target):
            subprocess.run(["umount", "-l", str(target)], capture_output=True)
