"""A real multi-node Slurm cluster on one machine, for the tests and for trying the CLIs by hand.

    python -m tests.slurm_testbed start [--dir .testbed] [--nodes 2] [--no-accounting]
    python -m tests.slurm_testbed status|stop [--dir .testbed]
    . .testbed/env.sh      # SLURM_CONF for the clients; then sinfo, sbatch, sacct, python -m jobs.submit ...

On a machine with GPUs, `--real-gpus` gives each node its share of them (tests/slurm_testbed_gpus.py, which
also runs Slurm from carried .deb files with `--slurm-debs`).

Each node is its own slurmd in its own UTS namespace (so tasks see hostname tb1, tb2, ...), advertising
8 GPUs through gres (fake device files: tasks get SLURM_GPUS_ON_NODE=8 but no CUDA_VISIBLE_DEVICES) and
16 CPUs. Accounting is real (slurmdbd + a private MariaDB), so `sacct` works. All state (configs, spool,
logs, pid files, the database) lives under one folder, and each folder gets its own ports, so two
testbeds (say a developer's and CI's) can run side by side. `start` keeps a testbed that already runs
there with the same configuration, else restarts it clean; `stop` ends only the daemons this testbed
started, by pid, and every process of its jobs, and leaves the folder for inspection. Needs root and
Debian's slurm-wlm, munge, slurmdbd and mariadb-server (scripts/setup.sh installs them).

The daemons are started and stopped here; the files they read (slurm.conf, gres.conf, slurmdbd.conf) and
MariaDB's settings are written by tests/slurm_testbed_config.py.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from taehv_slurm.runtime.distenv import PORT_BASE
from tests.slurm_testbed_config import (
    CLUSTER_NAME,
    PARTITION,
    TestbedError,
    accounting_db_sql,
    mariadbd_argv,
    slurm_conf,
    write_config_files,
)
from tests.slurm_testbed_gpus import (
    ensure_munge_user,
    freezer_mounted,
    host_gpus,
    mount_private_freezer,
    prefix_environ,
    split_gpus,
    unmount_private_freezer,
    unpack_slurm,
)
from tests.testbed_processes import (
    CHILDREN,
    alive,
    client_output,
    environ_with,
    log_tail,
    munge_works,
    other_slurm_daemons,
    read,
    succeeds,
    terminate,
    uts,
    wait_until,
    which,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / ".testbed"

# Each root folder gets its own block of PORT_BLOCK ports in 14000-19999: never a real Slurm's (6817-6819)
# or MariaDB's (3306), below the range jobs take their rendezvous port from (PORT_BASE up: a local job's
# port once landed on a slurmd's), and two testbeds (a developer's left running, CI's in a fresh clone on
# the same machine) can run side by side. Offsets in the block:
PORT_BLOCK, PORT_BLOCKS, CTLD_OFFSET, DBD_OFFSET, DB_OFFSET, FIRST_NODE_OFFSET = 50, 120, 0, 1, 2, 10
SETUP_HINT = "run `bash scripts/setup.sh` as root to install Slurm, munge and MariaDB"
# Unix sockets (MariaDB's, slurmd's per-step ones under the spool) must fit in 108 bytes.
MAX_ROOT_CHARS = 70



class Testbed:
    """A Slurm cluster of `nodes` nodes (tb1, tb2, ...) in one partition, with its state under `root`."""

    __test__ = False  # not a pytest test class, despite its name

    def __init__(self, root: Path | str = DEFAULT_ROOT, nodes: int = 2, gpus_per_node: int = 8,
                 cpus_per_node: int = 16, accounting: bool = True,
                 gpu_devices: Sequence[str] | None = None) -> None:
        """gpu_devices: real GPU device files (the host's /dev/nvidiaN), split evenly over the nodes in place
        of `gpus_per_node` fake ones (tests/slurm_testbed_gpus.py)."""
        if not 1 <= nodes <= PORT_BLOCK - FIRST_NODE_OFFSET or gpus_per_node < 0 or cpus_per_node < 1:
            raise ValueError(f"bad testbed shape: nodes={nodes} gpus_per_node={gpus_per_node} "
                             f"cpus_per_node={cpus_per_node}")
        self.root = Path(root).resolve()
        # each node's real device files; None: fake ones under <root>/dev
        self.gpu_shares = split_gpus(gpu_devices, nodes) if gpu_devices is not None else None
        if self.gpu_shares:
            gpus_per_node = len(self.gpu_shares[0])
        self.nodes, self.gpus_per_node, self.cpus_per_node = nodes, gpus_per_node, cpus_per_node
        # Slurm unpacked from Debian's packages (`unpack_slurm`), when it is there; else the system's.
        self.slurm_prefix = self.root / "slurm" if (self.root / "slurm/usr/sbin").is_dir() else None
        self.accounting = accounting
        self.etc, self.run, self.log = self.root / "etc", self.root / "run", self.root / "log"
        self.base_port = (PORT_BASE - PORT_BLOCK * PORT_BLOCKS
                          + PORT_BLOCK * (zlib.crc32(str(self.root).encode()) % PORT_BLOCKS))
        self.ctld_port, self.dbd_port, self.db_port = (self.base_port + o
                                                       for o in (CTLD_OFFSET, DBD_OFFSET, DB_OFFSET))
        # True when start() found this very testbed already up (e.g. started by the CLI) and kept it.
        self.reused = False

    # ----------------------------------------------------------------------------- public facts
    @property
    def cluster_name(self) -> str:
        return CLUSTER_NAME

    @property
    def partition(self) -> str:
        return PARTITION

    @property
    def node_names(self) -> list[str]:
        return [f"tb{i}" for i in range(1, self.nodes + 1)]

    @property
    def conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, sacct, submitit) needs in its environment."""
        found = prefix_environ(self.slurm_prefix, dict(os.environ)) if self.slurm_prefix else {}
        return {"SLURM_CONF": str(self.conf), **found}

    @property
    def cgroup_dir(self) -> Path:
        """Where slurmd's cgroup v1 freezer is mounted when the host has none (cgroup.conf names it)."""
        return self.root / "cgroup"

    def env_script(self) -> str:
        """`export` lines that make a shell a client of this testbed (written to <root>/env.sh)."""
        return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.env.items())

    # ------------------------------------------------------------------------------------ start
    def start(self) -> None:
        """Start munge, [MariaDB, slurmdbd,] slurmctld and the slurmds; return once every node is idle.

        A testbed already running in the same root with the same configuration (started by the CLI or an
        earlier test run) and healthy is kept as it is (`reused` is then true); anything else found there is
        stopped first and started clean. On failure, what was started is stopped again.
        """
        self._preflight()
        self.reused = self.is_up()
        if self.reused:
            return
        self.stop()
        self._check_ports_free()
        try:
            if self.slurm_prefix is not None:
                ensure_munge_user()
            if self.private_cgroup:
                mount_private_freezer(self.cgroup_dir)
            write_config_files(self)
            self._start_munge()
            if self.accounting:
                self._start_mariadb()
                self._start_slurmdbd()
            self._start_slurmctld()
            self._start_slurmds()
        except BaseException:
            self.stop()
            raise

    def _preflight(self) -> None:
        tools = ["slurmctld", "slurmd", "sinfo", "sbatch", "scontrol", "munged", "munge", "unshare",
                 "hostname"]
        if self.accounting:
            tools += ["slurmdbd", "sacctmgr", "mariadbd", "mariadb-install-db", "mysql", "mysqladmin"]
        missing = [t for t in tools if not which(t, self.env)]
        if missing:
            raise TestbedError(f"Slurm testbed: {', '.join(missing)} not found: {SETUP_HINT}")
        if os.geteuid() != 0:
            raise TestbedError("Slurm testbed: needs root (it starts munged, slurmd and writes /etc/hosts): "
                               "run the tests as root, after `bash scripts/setup.sh`")
        if len(str(self.root)) > MAX_ROOT_CHARS:
            raise TestbedError(f"Slurm testbed: folder path {self.root} is longer than {MAX_ROOT_CHARS} "
                               "characters, too long for its unix sockets: use a shorter --dir")

    @property
    def private_cgroup(self) -> bool:
        """slurmd gets a freezer of its own under `cgroup_dir`: the host mounts none (or it is ours)."""
        return os.path.ismount(self.cgroup_dir / "freezer") or not freezer_mounted()

    def node_port(self, index: int) -> int:
        """The port of the slurmd of node `index` (0 for tb1)."""
        return self.base_port + FIRST_NODE_OFFSET + index

    def _ports(self) -> dict[int, str]:
        ports = {self.ctld_port: "slurmctld"}
        ports |= {self.node_port(i): f"slurmd {n}" for i, n in enumerate(self.node_names)}
        if self.accounting:
            ports |= {self.dbd_port: "slurmdbd", self.db_port: "MariaDB"}
        return ports

    def _daemon_names(self) -> list[str]:
        return ((["mariadbd", "slurmdbd"] if self.accounting else []) + ["slurmctld"]
                + [f"slurmd-{n}" for n in self.node_names])

    def is_up(self) -> bool:
        """This root's testbed, with exactly this configuration, runs and answers."""
        if not self.conf.exists() or self.conf.read_text() != slurm_conf(self) or not munge_works(self.env):
            return False
        running = self._recorded_pids()
        if any(name not in running for name in self._daemon_names()):
            return False
        if "is UP" not in (client_output(["scontrol", "ping"], self.env, timeout_s=5) or ""):
            return False
        states = (client_output(["sinfo", "-h", "-N", "-o", "%N %t"], self.env, timeout_s=5) or "").split()
        healthy = {"idle", "mix", "alloc", "comp"}
        return sorted(states[::2]) == sorted(self.node_names) and all(s in healthy for s in states[1::2])

    def _check_ports_free(self) -> None:
        for port, what in self._ports().items():
            with socket.socket() as probe:
                probe.settimeout(0.5)
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    raise TestbedError(f"Slurm testbed: port {port} (for {what}) is already in use, "
                                       f"by a daemon this testbed ({self.root}) did not start: "
                                       f"stop that Slurm/testbed first")

    def _start_munge(self) -> None:
        if munge_works(self.env):
            return  # a munged already serves the default socket (the system's): use it, never stop it
        key = Path("/etc/munge/munge.key")
        for folder in ("/etc/munge", "/var/lib/munge", "/var/log/munge", "/run/munge"):
            Path(folder).mkdir(parents=True, exist_ok=True)
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        subprocess.run(["chown", "-R", "munge:munge", "/etc/munge", "/var/lib/munge", "/var/log/munge",
                        "/run/munge"], check=True)
        key.chmod(0o400)
        # As the munge user, in the foreground (so its pid is ours to stop and reap); --force: a munged
        # killed earlier may have left its socket behind.
        self._spawn("munged", ["munged", "--foreground", "--force"], user="munge")
        self._wait(lambda: munge_works(self.env), 10, "munged", Path("/var/log/munge/munged.log"), "munged")

    def _start_mariadb(self) -> None:
        """A private MariaDB (own datadir, socket and port under root): no system service is touched."""
        datadir, sock = self.root / "db", self.run / "mysqld.sock"
        if not (datadir / ".installed").exists():  # once per root: ~3 s
            shutil.rmtree(datadir, ignore_errors=True)
            with open(self.log / "mariadb-install.log", "wb") as out:
                done = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={datadir}",
                                       "--user=root",
                                       "--auth-root-authentication-method=socket", "--skip-test-db"],
                                      stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise TestbedError(f"Slurm testbed: mariadb-install-db failed; "
                                   f"{log_tail(self.log / 'mariadb-install.log')}")
            (datadir / ".installed").touch()
        self._spawn("mariadbd", mariadbd_argv(self, datadir, sock))
        ping = ["mysqladmin", "--no-defaults", f"--socket={sock}", "ping"]
        self._wait(lambda: succeeds(ping, self.env), 60,
                   "MariaDB",
                   self.log / "mariadbd.log", "mariadbd")
        sql = accounting_db_sql((self.etc / "db.password").read_text().strip())
        # The SQL goes through stdin so the password never shows in `ps`.
        done = subprocess.run(["mysql", "--no-defaults", f"--socket={sock}", "-u", "root"], input=sql,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise TestbedError(f"Slurm testbed: creating the accounting database failed: "
                               f"{done.stderr.strip()}")

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        clusters = ["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"]
        self._wait(lambda: client_output(clusters, self.env) is not None, 60, "slurmdbd",
                   self.log / "slurmdbd.log",
                   "slurmdbd")
        if CLUSTER_NAME not in (client_output(clusters, self.env, check=True) or "").split():
            client_output(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], self.env, check=True)

    def _start_slurmctld(self) -> None:
        # -c: forget the jobs of an earlier run (their nodes are gone) but keep the job id sequence, so ids
        # keep growing across restarts and sacct never mixes two runs' jobs.
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._wait(lambda: "is UP" in (client_output(["scontrol", "ping"], self.env) or ""), 30, "slurmctld",
                   self.log / "slurmctld.log", "slurmctld")

    def _start_slurmds(self) -> None:
        for name in self.node_names:
            # Own UTS namespace: the node's tasks see `hostname` == tbN. exec keeps one pid for the daemon.
            self._spawn(f"slurmd-{name}", ["unshare", "--uts", "sh", "-c",
                                           'hostname "$0" && exec slurmd -D -N "$0" -f "$1"',
                                           name, str(self.conf)])
        names = self.node_names

        def all_idle() -> bool:
            for name in names:
                if not self._daemonalive(f"slurmd-{name}"):
                    raise TestbedError(
                        f"Slurm testbed: slurmd {name} exited during start-up; "
                        f"{log_tail(self.log / f'slurmd-{name}.log', self.log / f'slurmd-{name}.out')}")
            sinfo = client_output(["sinfo", "-h", "-N", "-o", "%N %t"], self.env)
            states = dict(line.split() for line in (sinfo or "").splitlines() if len(line.split()) == 2)
            return all(states.get(n) == "idle" for n in names)

        self._wait(all_idle, 60, "the nodes (idle)", self.log / "slurmctld.log")

    # ------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Stop the daemons this testbed started (by their pid files), and every job process on its nodes."""
        if not self.run.is_dir():
            return
        pids = self._recorded_pids()
        if "slurmctld" in pids:
            # Cancel what still runs, so accounting closes those jobs (CANCELLED) instead of leaving them
            # RUNNING.
            ids = (client_output(["squeue", "-h", "-o", "%A"], self.env) or "").split()
            if ids:
                client_output(["scancel", *ids], self.env)
        slurmds = [pid for name, pid in pids.items() if name.startswith("slurmd-")]
        namespaces = {uts(pid) for pid in slurmds}
        # Give cancelled tasks a moment to end on SIGTERM; then SIGKILL what is left (submitit's tasks ignore
        # SIGTERM, and Slurm would wait KillWait=30 s): slurmstepd and the tasks, which would outlive slurmd
        # and which slurmd would otherwise wait for before it exits.
        wait_until(lambda: not self._job_processes(namespaces, exclude=slurmds), 2)
        terminate(self._job_processes(namespaces, exclude=slurmds), sig=signal.SIGKILL)
        terminate(slurmds)
        # in case slurmd forked more
        terminate(self._job_processes(namespaces, exclude=[]), sig=signal.SIGKILL)
        for name in ("slurmctld", "slurmdbd", "mariadbd"):
            if name in pids:
                terminate([pids[name]], timeout_s=20)
        # The munged we started may since serve another Slurm (another testbed, which found it running and
        # so reused it): then it stays up for that one.
        if "munged" in pids and not other_slurm_daemons():
            terminate([pids["munged"]])
        for pid_file in self.run.glob("*.pid"):
            pid_file.unlink(missing_ok=True)
        unmount_private_freezer(self.cgroup_dir)

    def _recorded_pids(self) -> dict[str, int]:
        """name -> pid of the daemons whose pid file is here and which are still alive and ours."""
        found: dict[str, int] = {}
        for pid_file in self.run.glob("*.pid"):
            name = pid_file.stem
            if name.endswith(".own"):
                continue  # the daemons' own pid files: ours are authoritative
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pid_file.unlink(missing_ok=True)
                continue
            if self._is_ours(name, pid):
                found[name] = pid
            else:
                # stale: that process is gone, or the pid now is someone else's
                pid_file.unlink(missing_ok=True)
        return found

    def _is_ours(self, name: str, pid: int) -> bool:
        if not alive(pid):
            return False
        if name == "munged":
            return read(f"/proc/{pid}/comm").strip() == "munged"
        # Every daemon we start names the root in its command line or (slurmdbd) in SLURM_CONF.
        marker = str(self.root)
        return (marker in read(f"/proc/{pid}/cmdline").replace("\0", " ")
                or marker in read(f"/proc/{pid}/environ"))

    def _daemonalive(self, name: str) -> bool:
        pid_file = self.run / f"{name}.pid"
        try:
            return alive(int(pid_file.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            return False

    def _job_processes(self, namespaces: set[str], exclude: Iterable[int]) -> list[int]:
        """Every process on this testbed's nodes (slurmstepd, batch scripts, tasks), but `exclude`.

        A node is a UTS namespace: those of our live slurmds (`namespaces`), and any other (not ours, the
        host's) where a process carries this testbed's SLURM_CONF: the node of a slurmd that died, whose
        slurmstepds (they inherit slurmd's environment) and tasks live on.
        """
        host, marker = uts(os.getpid()), f"SLURM_CONF={self.conf}\0"
        processes = {int(e.name): uts(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()}
        nodes = set(namespaces) | {ns for pid, ns in processes.items()
                                   if ns != host and marker in read(f"/proc/{pid}/environ")}
        nodes -= {host, ""}
        skip = set(exclude) | {os.getpid()}
        return [pid for pid, ns in processes.items() if ns in nodes and pid not in skip and alive(pid)]

    # ---------------------------------------------------------------------------------- helpers
    def _spawn(self, name: str, argv: list[str], user: str | None = None) -> None:
        with open(self.log / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(argv, env=environ_with(self.env), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT,
                                    start_new_session=True,  # no Ctrl-C from our terminal
                                    user=user, group=user, extra_groups=[] if user else None)
        CHILDREN[proc.pid] = proc
        (self.run / f"{name}.pid").write_text(f"{proc.pid}\n")

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str, log: Path,
              daemon: str | None = None) -> None:
        """Poll `ready` until it is true; fail fast if `daemon` exits meanwhile, with its log's tail."""
        deadline = time.monotonic() + timeout_s
        while True:
            if ready():
                return
            if daemon and not self._daemonalive(daemon):
                raise TestbedError(f"Slurm testbed: {what} exited during start-up; "
                                   f"{log_tail(log, self.log / f'{daemon}.out')}")
            if time.monotonic() > deadline:
                raise TestbedError(f"Slurm testbed: {what} not ready after {timeout_s:.0f} s; "
                                   f"{log_tail(log)}")
            time.sleep(0.1)

    def status(self) -> str:
        lines = [f"{name}: pid {pid}" for name, pid in sorted(self._recorded_pids().items())]
        if not lines:
            return f"no testbed daemon running under {self.root}"
        lines.append(client_output(["sinfo", "-N", "-o", "%N %P %t %c %G"], self.env) or "sinfo failed")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.slurm_testbed",
                                     description="A real multi-node Slurm cluster on this machine "
                                                 "(needs root).")
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_ROOT,
                        help="state folder (default: <repo>/.testbed)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=None,
                        help="CPUs each node declares (default 16; with --real-gpus this host's cores over "
                             "the nodes)")
    parser.add_argument("--no-accounting", action="store_true",
                        help="no slurmdbd/MariaDB (sacct will not work)")
    parser.add_argument("--real-gpus", action="store_true",
                        help="give the nodes this host's GPUs (/dev/nvidiaN), split evenly, instead of 8 "
                             "fake ones each")
    parser.add_argument("--slurm-debs", type=Path, default=None,
                        help="a folder of Debian 12's Slurm and munge .deb files to run from (unpacked "
                             "under --dir), where Slurm is not installed")
    args = parser.parse_args(argv)
    try:
        if args.action == "start" and args.slurm_debs is not None:
            unpack_slurm(args.slurm_debs, args.dir.resolve() / "slurm")
        devices = host_gpus() if args.real_gpus else None
        if args.real_gpus and not devices:
            raise TestbedError("Slurm testbed: --real-gpus but this host shows no /dev/nvidiaN device")
        cpus = args.cpus_per_node or (max(1, (os.cpu_count() or 2) // args.nodes) if devices else 16)
        bed = Testbed(args.dir, nodes=args.nodes, cpus_per_node=cpus, accounting=not args.no_accounting,
                      gpu_devices=devices)
        if args.action == "start":
            began = time.monotonic()
            bed.start()
            (bed.root / "env.sh").write_text(bed.env_script())
            how = "already running, kept" if bed.reused else f"up in {time.monotonic() - began:.1f} s"
            print(f"testbed {how}; for the clients:\n  . {bed.root / 'env.sh'}")
            print(bed.status())
        elif args.action == "stop":
            bed.stop()
            print(f"testbed under {bed.root} stopped")
        else:
            print(bed.status())
    except TestbedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
