"""The quickest cluster check: every rank joins the process group, all-reduces, and reports itself.

`taehv submit --task smoke --nodes 2` runs it; the preflight job adds bus-bandwidth
measurements. torch is imported inside the call, so submitting it never needs torch.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from taehv_slurm.runtime import network
from taehv_slurm.runtime.distenv import DistEnv, destroy_distributed, init_distributed


class SmokeTask:
    """Picklable callable; returns this rank's facts (rank, local rank, node, host, device, sum)."""

    def __init__(self, backend: str = "auto", rendezvous_timeout_s: float = 120.0, timeout_s: float = 600.0,
                 bandwidth_mib: tuple[int, ...] = ()) -> None:
        self.backend = backend
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.timeout_s = timeout_s
        self.bandwidth_mib = tuple(bandwidth_mib)

    def __call__(self, ctx: Any = None) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        env = DistEnv.from_environ()
        start = time.monotonic()
        backend = init_distributed(env, self.backend, self.timeout_s, self.rendezvous_timeout_s)
        rendezvous_s = time.monotonic() - start
        device = torch.device("cuda", env.local_rank) if backend == "nccl" else torch.device("cpu")
        value = torch.tensor([float(env.rank)], device=device)
        dist.all_reduce(value)
        facts: dict[str, Any] = {
            "rank": env.rank,
            "local_rank": env.local_rank,
            "world_size": env.world_size,
            "node_rank": env.node_rank,
            "num_nodes": env.num_nodes,
            "host": socket.gethostname(),
            "source": env.source,
            "backend": backend,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "gpus_visible": torch.cuda.device_count(),
            "slurm_gpus_on_node": os.environ.get("SLURM_GPUS_ON_NODE"),
            "driver": _driver_version(),
            "torch": torch.__version__,
            "sum": float(value.item()),
            "expected_sum": env.world_size * (env.world_size - 1) / 2,
            "rendezvous_s": round(rendezvous_s, 3),
            "bus_bandwidth_gbps": {size: _bus_bandwidth(size, device) for size in self.bandwidth_mib},
            "network": network.transport(backend, env.world_size, env.num_nodes),
            "infiniband": network.infiniband_devices(),
        }
        dist.barrier()
        destroy_distributed()
        return facts


def _bus_bandwidth(size_mib: int, device: Any, repeats: int = 5) -> float:
    """All-reduce bus bandwidth in GB/s (nccl-tests' definition: 2(n−1)/n × bytes / time)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    tensor = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / repeats
    return round(2 * (n - 1) / max(n, 1) * tensor.numel() * 4 / seconds / 1e9, 3)


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().split("Kernel Module")[-1].split()[0]
    except (OSError, IndexError):
        return None
