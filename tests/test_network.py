"""What the ranks talk over between nodes, read from what NCCL itself printed, and the warning when a node
with InfiniBand devices falls back to sockets. The NET lines are NCCL's own format (2.18–2.28); a node's
InfiniBand devices are read from a sysfs folder, here a stand-in with the kernel's layout."""

from __future__ import annotations

from pathlib import Path

from taehv_slurm.runtime import network

SOCKET = "gnode1:4021:4021 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.3.7<0>"
IB = ("dgx1:77:77 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [RO]; "
      "OOB ib0:10.1.0.5<0>")
ROCE = "node7:12:12 [1] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.2.0.9<0>"


def test_the_transport_and_devices_come_from_nccls_net_line() -> None:
    assert network.parse_nccl(f"noise\n{SOCKET}\nNCCL INFO Using network Socket\n") == {
        "transport": "Socket", "devices": ["eth0:10.0.3.7"]}
    assert network.parse_nccl(IB) == {"transport": "IB", "devices": ["mlx5_0:1/IB", "mlx5_1:1/IB",
                                                                      "mlx5_2:1/IB"]}
    assert network.parse_nccl(ROCE)["transport"] == "RoCE"
    assert network.parse_nccl("NCCL INFO Bootstrap : Using eth0:10.0.3.7<0>\n") == {}


def test_sockets_on_a_node_with_infiniband_devices_name_the_settings_to_check(tmp_path: Path) -> None:
    sysfs = tmp_path / "infiniband"
    sysfs.mkdir()
    fell_back = {"backend": "nccl", "nodes": 2, **network.parse_nccl(SOCKET)}
    assert network.warning(fell_back, network.infiniband_devices(sysfs)) is None  # no devices: as meant
    for name in ("mlx5_0", "mlx5_1"):
        (sysfs / name).mkdir()
    line = network.warning(fell_back, network.infiniband_devices(sysfs))
    assert line is not None and "\n" not in line
    assert "over sockets (eth0:10.0.3.7)" in line and "(mlx5_0, mlx5_1)" in line
    assert "NCCL_IB_HCA=mlx5" in line and "NCCL_SOCKET_IFNAME" in line
    on_ib = {"backend": "nccl", "nodes": 2, **network.parse_nccl(IB)}
    one_node = {**fell_back, "nodes": 1}  # within a node NCCL uses no network
    assert network.warning(on_ib, ["mlx5_0"]) is None and network.warning(one_node, ["mlx5_0"]) is None
