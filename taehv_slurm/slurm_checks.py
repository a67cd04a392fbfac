"""What Slurm says of a cluster config before a job waits in its queue: the partition, its nodes' GPUs, CPUs
and memory, accounting, and what a preemption does there. Rows as taehv_slurm.submit_checks gives them (check,
PASS | WARN | FAIL | SKIP, detail), every FAIL naming what to change; `taehv preflight` prints them.

Where Slurm cannot be reached (a laptop, a workstation), `not_checked_rows` gives the same rows, each
`not checked here (no Slurm)` with what it would check: `taehv submit --dry-run` and `taehv preflight`
show them there and check everything else as on a login node.
"""

from __future__ import annotations

from taehv_slurm import slurm
from taehv_slurm.common.config import ClusterConfig
from taehv_slurm.common.messages import command
from taehv_slurm.followup import partition_preempt_mode
from taehv_slurm.submit_checks import Row

NOT_CHECKED = "not checked here (no Slurm)"


def slurm_rows(c: ClusterConfig) -> list[Row]:
    """The partition, the nodes that fit one node's share, accounting and the requeue setting."""
    rows: list[Row] = []
    part = _partition(c, rows)
    if part is not None:
        _nodes(c, part, rows)
    _site(c, rows)
    return rows


def not_checked_rows(c: ClusterConfig, reason: str) -> list[Row]:
    """`slurm_rows`' checks where no Slurm answers (`reason`, the first row): each says what it would
    check."""
    need_cpus = int(c.tasks_per_node or 1) * c.cpus_per_task
    gres = (Row("GPUs (gres)", "SKIP", f"{NOT_CHECKED}: nodes that offer {c.gres_request}") if c.gres_request
            else Row("GPUs (gres)", "SKIP", "no GPUs requested (gpus_per_node 0)"))
    memory = [Row("memory", "SKIP", f"{NOT_CHECKED}: nodes with mem_gb {c.mem_gb:g}")] if c.mem_gb else []
    return [Row("Slurm", "SKIP", reason),
            Row("partition", "SKIP", f"{NOT_CHECKED}: {c.partition or 'the default partition'} is up and "
                                     f"allows time_min {c.time_min}"),
            gres,
            Row("CPUs", "SKIP", f"{NOT_CHECKED}: nodes with {need_cpus} CPUs"),
            *memory,
            Row("nodes", "SKIP", f"{NOT_CHECKED}: {c.nodes} node(s) that fit one node's share"),
            Row("accounting", "SKIP", f"{NOT_CHECKED}: whether sacct keeps each attempt"),
            Row("requeue", "SKIP", f"{NOT_CHECKED}: whether a preemption requeues the job (PreemptMode)")]


def _partition(c: ClusterConfig, rows: list[Row]) -> str | None:
    """The partition row; the partition's name when it is usable."""
    answer = slurm.sinfo(["-h", "-o", "%P|%a|%D|%l"])
    if not answer.ok:
        rows.append(Row("partition", "FAIL", answer.error))
        return None
    listed = {}
    default = None
    for line in answer.output.splitlines():
        name, avail, count, limit = line.split("|")
        if name.endswith("*"):
            name = default = name[:-1]
        listed[name] = (avail, int(count), limit)
    part = c.partition or default
    if part not in listed:
        rows.append(Row("partition", "FAIL", f"partition {part!r} not found; "
                                             f"sinfo lists: {', '.join(listed) or 'none'}: "
                                             "set partition (or --partition) to one of them"))
        return None
    avail, count, limit = listed[part]
    limit_min = slurm.limit_minutes(limit)
    if avail != "up":
        rows.append(Row("partition", "FAIL",
                        f"partition {part} is {avail}: ask the admins, or use another one"))
        return None
    if limit_min is not None and c.time_min > limit_min:
        rows.append(Row("partition", "FAIL", f"time_min {c.time_min} exceeds partition {part}'s limit of "
                                             f"{limit}: lower time_min to {limit_min} (the job requeues "
                                             "itself at the limit)"))
        return None
    rows.append(Row("partition", "PASS", f"{part}: up, {count} node(s), time limit {limit}"))
    return part


def _nodes(c: ClusterConfig, part: str, rows: list[Row]) -> None:
    """The rows of what one node's share needs (GPUs, CPUs, memory) against the partition's nodes."""
    answer = slurm.sinfo(["-h", "-N", "-p", part, "-o", "%N|%T|%c|%G|%m"])
    if not answer.ok:
        rows.append(Row("nodes", "FAIL", answer.error))
        return
    info = {}
    for line in answer.output.splitlines():
        host, state, cpus, gres, mem = line.split("|")
        info[host] = (state.rstrip("*~#!%$@^-+").lower(), int(cpus), gres, int(mem or 0))
    usable = {h: v for h, v in info.items() if v[0] in slurm.USABLE_NODE_STATES}
    fits = _resources(c, info, usable, rows)
    # with no gres requested every usable node is in "gres"
    fit = fits["gres"] & fits["cpus"] & fits["mem"]
    detail = (f"{len(fit)} node(s) in {part} fit one node's share ({len(info)} in the partition, "
              f"{len(usable)} usable); need {c.nodes}")
    if not fit:
        rows.append(Row("nodes", "FAIL", f"{detail}: fix the rows above"))
    elif len(fit) < c.nodes:
        rows.append(Row("nodes", "FAIL", f"{detail}: lower --nodes to {len(fit)} or pick another partition "
                                         "(Slurm may accept the job and leave it pending forever)"))
    else:
        rows.append(Row("nodes", "PASS", detail))


def _resources(c: ClusterConfig, info: dict[str, tuple], usable: dict[str, tuple],
               rows: list[Row]) -> dict[str, set]:
    """The GPUs, CPUs and memory rows; for each resource, the usable nodes that have enough."""
    fits: dict[str, set[str]] = {"gres": set(), "cpus": set(), "mem": set()}
    want_gres = slurm.parse_gres(c.gres_request or "")
    need_cpus = int(c.tasks_per_node or 1) * c.cpus_per_task
    for host, (_, cpus, gres, mem) in usable.items():
        have = slurm.parse_gres(gres)
        if all(have.get(key, 0) >= n for key, n in want_gres.items()):
            fits["gres"].add(host)
        if cpus >= need_cpus:
            fits["cpus"].add(host)
        if c.mem_gb is None or mem >= c.mem_gb * 1024:
            fits["mem"].add(host)
    offered = ", ".join(sorted({v[2] for v in info.values()})) or "none"
    if want_gres:
        ok = len(fits["gres"]) > 0
        rows.append(Row("GPUs (gres)", "PASS" if ok else "FAIL",
                        f"{len(fits['gres'])} of {len(usable)} usable node(s) "
                        f"offer {c.gres_request} (nodes have "
                        f"{offered})"
                        + ("" if ok else ": set gpus_per_node (or gres) to what the nodes have")))
    else:
        rows.append(Row("GPUs (gres)", "SKIP", "no GPUs requested (gpus_per_node 0)"))
    most = max((v[1] for v in usable.values()), default=0)
    ok = len(fits["cpus"]) > 0
    fix = f": lower cpus_per_task to {max(1, most // int(c.tasks_per_node or 1))}"
    rows.append(Row("CPUs", "PASS" if ok else "FAIL",
                    f"{need_cpus} CPUs per node = {c.tasks_per_node} tasks × {c.cpus_per_task} "
                    f"cpus_per_task; {len(fits['cpus'])} of {len(usable)} usable node(s) have that many "
                    f"(at most {most})" + ("" if ok else fix)))
    if c.mem_gb is not None:
        ok = len(fits["mem"]) > 0
        biggest = max((v[3] for v in usable.values()), default=0) / 1024
        rows.append(Row("memory", "PASS" if ok else "FAIL",
                        f"mem_gb {c.mem_gb:g} per node; {len(fits['mem'])} node(s) have that much (at most "
                        f"{biggest:.0f} GB)"
                        + ("" if ok else f": lower mem_gb to {int(biggest)} or leave it null")))
    return fits


def _site(c: ClusterConfig, rows: list[Row]) -> None:
    """Accounting (sacct's record of each attempt) and what a preemption does, from the cluster's settings."""
    config = slurm.show_config()
    if not isinstance(config, dict):
        rows.append(Row("accounting", "WARN", f"scontrol show config: {config.error}"))
        return
    storage = config.get("AccountingStorageType", "")
    if storage.endswith("/none") or not storage:
        rows.append(Row("accounting", "WARN", f"none (AccountingStorageType={storage or 'unset'}): "
                                              f"`{command('status')} --accounting` has no rows, and goodput "
                                              "counts node-hours from the run's own files"))
    else:
        rows.append(Row("accounting", "PASS", f"{storage}: sacct keeps each attempt "
                                              f"(`{command('status')} --accounting`, goodput's node-hours)"))
    preempt = partition_preempt_mode(c.partition) or config.get("PreemptMode", "OFF")
    requeue = config.get("JobRequeue", "?")
    if slurm.site_requeues({**config, "PreemptMode": preempt}) and c.requeue != "follow_up":
        rows.append(Row("requeue", "PASS", f"PreemptMode={preempt}, JobRequeue={requeue}; the job asks "
                                           "--requeue: a preemption or the time limit saves, requeues and "
                                           "resumes"))
    elif c.requeue == "self":
        rows.append(Row("requeue", "WARN", f"PreemptMode={preempt}, JobRequeue={requeue}: the cluster ends "
                                           "a preempted job instead of requeueing it, and requeue: self asks "
                                           "for no follow-up job; submit the same --name again to resume, or "
                                           "set requeue: auto"))
    else:
        rows.append(Row("requeue", "PASS", f"PreemptMode={preempt}, JobRequeue={requeue}: after a preemption "
                                           "or the time limit every rank saves and the run goes on as a "
                                           "follow-up job (docs/failures.md)"))
