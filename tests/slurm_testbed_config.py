"""The Slurm testbed's configuration: the files its daemons read and the settings they start with.

slurm.conf, gres.conf (and the fake GPU device files it names), slurmdbd.conf (with the accounting
database's password), the node names in /etc/hosts, and MariaDB's command line and accounting database.
tests/slurm_testbed.py starts the daemons on them.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from tests.slurm_testbed_gpus import gres_lines, plugin_dir, task_prolog
from tests.testbed_processes import TestbedError

if TYPE_CHECKING:  # only for the annotations: tests.slurm_testbed imports this module
    from tests.slurm_testbed import Testbed

CLUSTER_NAME, PARTITION = "taehvtb", "tb"
DB_NAME, DB_USER = "slurm_acct_db", "slurm"




def write_config_files(bed: Testbed) -> None:
    """The testbed's folders, fake GPU device files, node names in /etc/hosts and its config files."""
    for sub in ("etc", "run", "log", "dev", "spool/ctld", *(f"spool/{n}" for n in bed.node_names)):
        (bed.root / sub).mkdir(parents=True, exist_ok=True)
    # gres drops GPUs without device files; plain files are enough for Slurm to count them.
    for i in range(0 if bed.gpu_shares else bed.gpus_per_node):
        (bed.root / "dev" / f"nvidia{i}").touch()
    map_to_loopback(bed.node_names)
    if bed.accounting:
        password_file = bed.etc / "db.password"
        if not password_file.exists():
            password_file.touch(mode=0o600)
            password_file.write_text(secrets.token_hex(16))
        # slurmdbd has no option for its config: it reads slurmdbd.conf beside SLURM_CONF.
        write_private(bed.etc / "slurmdbd.conf", slurmdbd_conf(bed, password_file.read_text().strip()))
    bed.conf.write_text(slurm_conf(bed))
    (bed.etc / "gres.conf").write_text(gres_conf(bed))
    cgroup = bed.etc / "cgroup.conf"  # slurmd reads it beside slurm.conf
    if bed.private_cgroup:
        cgroup.write_text(f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={bed.cgroup_dir}\nCgroupAutomount=no\n")
    else:
        cgroup.unlink(missing_ok=True)
    if bed.gpu_shares:
        prolog = bed.etc / "task_prolog.sh"
        prolog.write_text(task_prolog(bed.node_names, bed.gpu_shares))
        prolog.chmod(0o755)


def slurmdbd_conf(bed: Testbed, password: str) -> str:
    """slurmdbd.conf: slurmdbd on its port, storing into the private MariaDB with `password`."""
    return "\n".join([
        "AuthType=auth/munge", "DbdHost=localhost", f"DbdPort={bed.dbd_port}", "SlurmUser=root",
        "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1", f"StoragePort={bed.db_port}",
        f"StorageUser={DB_USER}", f"StoragePass={password}", f"StorageLoc={DB_NAME}",
        f"LogFile={bed.log}/slurmdbd.log", f"PidFile={bed.run}/slurmdbd.own.pid",
    ]) + "\n"


def gres_conf(bed: Testbed) -> str:
    """gres.conf: each node's share of the host's GPUs, or fake device files under the testbed's dev/ (empty
    without GPUs)."""
    if bed.gpu_shares:
        return gres_lines(bed.node_names, bed.gpu_shares)
    if not bed.gpus_per_node:
        return ""
    files = "nvidia0" if bed.gpus_per_node == 1 else f"nvidia[0-{bed.gpus_per_node - 1}]"
    return f"Name=gpu File={bed.root}/dev/{files}\n"


def slurm_conf(bed: Testbed) -> str:
    """slurm.conf: the controller, the nodes tb1, tb2, ... on their own ports, the partition, accounting."""
    r = bed.root
    lines = [
        f"ClusterName={CLUSTER_NAME}",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={bed.ctld_port}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        # A requeued job may only start again once its old credential expired: cred_expire + 1 s (default
        # 121 s). 5 is the shortest Slurm accepts.
        "AuthInfo=cred_expire=5",
        f"StateSaveLocation={r}/spool/ctld", f"SlurmdSpoolDir={r}/spool/%n",
        f"SlurmctldPidFile={r}/run/slurmctld.own.pid", f"SlurmdPidFile={r}/run/slurmd-%n.own.pid",
        f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SwitchType=switch/none",
        # CR_Core: several small jobs share a node concurrently, each with its own cores and GPUs.
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "JobRequeue=1", "ReturnToService=2", "KillWait=30", "InactiveLimit=0",
        # Lets a 2-core machine declare 16 CPUs per node (enough for 8 tasks) and any memory.
        "SlurmdParameters=config_overrides",
        # Jobs start on the main scheduler's periodic pass: every second (default 60 s), so a job starts
        # ~0.5 s after sbatch and a requeued one as soon as its old credential expired. Backfill (which
        # lets small jobs pass a blocked big one) cycles every 2 s instead of 30.
        "SchedulerParameters=sched_interval=1,bf_interval=2",
        # Finished jobs stay in squeue (state COMPLETED/FAILED) for 5 min: tests read the final state
        # there even without accounting; with it, sacct has it within a second anyway.
        "MinJobAge=300",
        "JobCompType=jobcomp/none", "MailProg=/bin/true",  # no mail on this machine: keeps the log clean
    ]
    if bed.slurm_prefix is not None:
        lines.append(f"PluginDir={plugin_dir(bed.slurm_prefix)}")
    if bed.gpu_shares:  # each node's GPUs in the host's numbering (tests/slurm_testbed_gpus.py)
        lines.append(f"TaskProlog={bed.etc}/task_prolog.sh")
    if bed.gpus_per_node:
        lines.append("GresTypes=gpu")
    lines += accounting_lines(bed)
    memory_mb = max(1000, total_memory_mb() // bed.nodes)  # only checked against --mem requests (CR_Core)
    gres = f" Gres=gpu:{bed.gpus_per_node}" if bed.gpus_per_node else ""
    for i, name in enumerate(bed.node_names):
        lines.append(f"NodeName={name} NodeAddr=127.0.0.1 Port={bed.node_port(i)} CPUs={bed.cpus_per_node} "
                     f"Boards=1 SocketsPerBoard=1 CoresPerSocket={bed.cpus_per_node} ThreadsPerCore=1 "
                     f"RealMemory={memory_mb}{gres} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(bed.node_names)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def accounting_lines(bed: Testbed) -> list[str]:
    """slurm.conf's accounting settings: through slurmdbd, sampled every second; or none at all."""
    if not bed.accounting:
        return ["AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none"]
    lines = ["AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=localhost",
             f"AccountingStoragePort={bed.dbd_port}", "JobAcctGatherType=jobacct_gather/linux",
             # Sampled every second (Slurm's default is 30 s): a step of the tests' short jobs that is
             # ended by a requeue may otherwise never be sampled, and sacct shows no MaxRSS for it.
             "JobAcctGatherFrequency=task=1"]
    if bed.gpus_per_node:  # GPUs in each job's accounting (AllocTRES), as sites that bill GPUs set it
        lines.append("AccountingStorageTRES=gres/gpu")
    return lines


def mariadbd_argv(bed: Testbed, datadir: Path, sock: Path) -> list[str]:
    """The private MariaDB's command line: own datadir, socket, port and pid file under the testbed's root."""
    return [
        "mariadbd", "--no-defaults", f"--datadir={datadir}", f"--socket={sock}", f"--port={bed.db_port}",
        "--bind-address=127.0.0.1", f"--pid-file={bed.run}/mariadbd.own.pid",
        f"--log-error={bed.log}/mariadbd.log",
        "--user=root", "--skip-name-resolve",
        # A throwaway database: no fsync per commit (each job start and end is one); and the sizes
        # slurmdbd checks for, so it logs no "not recommended" error.
        "--innodb-flush-log-at-trx-commit=2", "--innodb-buffer-pool-size=512M",
        "--innodb-lock-wait-timeout=900",
    ]


def accounting_db_sql(password: str) -> str:
    """SQL that creates the accounting database and slurmdbd's account on it (again: same password)."""
    account = f"'{DB_USER}'@'127.0.0.1'"  # slurmdbd connects over TCP; --skip-name-resolve: by address
    return (f"CREATE DATABASE IF NOT EXISTS {DB_NAME};"
            f"CREATE USER IF NOT EXISTS {account} IDENTIFIED BY '{password}';"
            f"ALTER USER {account} IDENTIFIED BY '{password}';"
            f"GRANT ALL ON {DB_NAME}.* TO {account};")


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only."""
    path.touch(mode=0o600)
    path.chmod(0o600)  # slurmdbd refuses a slurmdbd.conf others can read (it holds the DB password)
    path.write_text(text)


def total_memory_mb() -> int:
    """The machine's memory in MB, from /proc/meminfo (4000 if it cannot be read)."""
    try:
        meminfo = Path("/proc/meminfo").read_bytes().decode(errors="replace")
    except OSError:
        meminfo = ""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 4000


def map_to_loopback(names: list[str]) -> None:
    """Make the node names resolve to 127.0.0.1 (MASTER_ADDR is the first node's name), idempotently."""
    hosts = Path("/etc/hosts")
    known: dict[str, str] = {}
    for line in hosts.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        for name in fields[1:]:
            known.setdefault(name, fields[0])
    wrong = [f"{n} -> {known[n]}" for n in names if n in known and not known[n].startswith("127.")]
    if wrong:
        raise TestbedError(f"Slurm testbed: /etc/hosts maps {', '.join(wrong)}, not to 127.0.0.1: "
                           "fix /etc/hosts")
    missing = [n for n in names if n not in known]
    if missing:
        with hosts.open("a") as out:
            out.write(f"127.0.0.1 {' '.join(missing)}  # taehv-slurm testbed nodes\n")
