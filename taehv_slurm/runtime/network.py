"""The network the ranks really talk over between nodes, as the collective library chose it.

NCCL picks its transport between nodes when a communicator starts: InfiniBand or RoCE (its IB verbs
transport), or plain sockets — silently, also on a node whose InfiniBand it could not use (a wrong
NCCL_IB_HCA, a missing driver in a container), which costs a large share of the speed. So where NCCL
starts (several ranks on GPUs) and the site set no NCCL_DEBUG of its own, each rank has NCCL write its
INIT and NET lines to a file of its own (`nccl_debug_file`), and `transport` reads from it what NCCL chose:

    NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ; OOB ib0:10.1.0.5<0>     →  IB / RoCE, the devices
    NET/Socket : Using [0]eth0:10.0.0.5<0>                                  →  Socket, the interface

gloo (CPU ranks) talks TCP over the interface the host name resolves to (or GLOO_SOCKET_IFNAME). The run
records it with the attempt (`RunFolder.attempts`) and logs it at the start; `warning` names the settings to
check when a node has InfiniBand devices and NCCL chose sockets.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any

NCCL_LOG_ENV = "TAEHV_NCCL_LOG"  # where this process's NCCL writes its INIT/NET lines
INFINIBAND = Path("/sys/class/infiniband")
_NET_LINE = re.compile(r"NET/(\w+)\s*:\s*Using\s+(.*)")
_DEVICE = re.compile(r"\[\d+\]([^\s;\[]+)")


def nccl_debug_file() -> Path | None:
    """Have NCCL write its start-up and network lines to a file of this process's (set before the process
    group starts); None where the site set NCCL_DEBUG itself (its settings stand)."""
    if "NCCL_DEBUG" in os.environ:
        return None
    path = Path(tempfile.gettempdir()) / f"taehv-nccl-{socket.gethostname()}-{os.getpid()}.log"
    os.environ.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(path),
                       NCCL_LOG_ENV: str(path)})
    return path


def parse_nccl(text: str) -> dict[str, Any]:
    """What NCCL's NET lines say it uses: {"transport": IB | RoCE | IB+RoCE | Socket | <plugin>,
    "devices": [...]}; {} where they say nothing."""
    for line in reversed(text.splitlines()):
        found = _NET_LINE.search(line)
        if not found:
            continue
        net, devices = found.group(1), _DEVICE.findall(found.group(2))
        if net == "IB":  # each device says its link layer: mlx5_0:1/IB, mlx5_2:1/RoCE
            layers = sorted({d.rsplit("/", 1)[-1] for d in devices if "/" in d}) or ["IB"]
            net = "+".join(layers)
        return {"transport": net, "devices": [re.sub(r"<\d+>$", "", d) for d in devices]}
    return {}


def transport(backend: str, world_size: int, num_nodes: int) -> dict[str, Any]:
    """How this rank's collectives travel between nodes: {"backend", "transport", "devices"} (NCCL: what it
    chose, from its file; gloo: TCP over the host's interface), {"transport": "none"} within one process."""
    info: dict[str, Any] = {"backend": backend, "nodes": num_nodes}
    if world_size == 1:
        return {**info, "transport": "none"}
    if backend == "gloo":
        address = os.environ.get("GLOO_SOCKET_IFNAME") or _host_address()
        return {**info, "transport": "Socket", "devices": [address]}
    log = os.environ.get(NCCL_LOG_ENV)
    try:
        text = Path(log).read_text(errors="replace") if log else ""
        if log:
            Path(log).unlink()  # read once; NCCL's later lines go to the file it keeps open
    except OSError:
        text = ""
    found = parse_nccl(text)
    if not found:
        why = "NCCL_DEBUG is set by the site" if not log else "NCCL said nothing of its network"
        return {**info, "transport": "unknown", "why": why}
    return {**info, **found}


def infiniband_devices(root: Path = INFINIBAND) -> list[str]:
    """The node's InfiniBand/RoCE devices (mlx5_0, ...) as the kernel lists them."""
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


def warning(info: dict[str, Any], devices: list[str]) -> str | None:
    """One line when NCCL talks sockets between nodes although the node has InfiniBand/RoCE devices."""
    if info.get("backend") != "nccl" or info.get("transport") != "Socket" or not devices \
            or int(info.get("nodes") or 1) < 2:
        return None
    return (f"NCCL talks between nodes over sockets ({', '.join(info.get('devices') or []) or '?'}) although "
            f"this node has InfiniBand/RoCE devices ({', '.join(devices)}): set NCCL_IB_HCA (e.g. "
            f"NCCL_IB_HCA={devices[0].split('_')[0]}) in the cluster config's env so NCCL uses them, and "
            "NCCL_SOCKET_IFNAME to the interface its bootstrap should use; NCCL_DEBUG=INFO says why it "
            "fell back")


def describe(info: dict[str, Any]) -> str:
    """'NCCL over IB (mlx5_0:1/IB, mlx5_1:1/IB)' for a log line or a status row."""
    devices = f" ({', '.join(info['devices'])})" if info.get("devices") else ""
    why = f" ({info['why']})" if info.get("why") else ""
    return f"{info.get('backend', '?')} over {info.get('transport', '?')}{devices}{why}"


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"
