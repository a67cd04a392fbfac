"""Every question we ask Slurm and every order we give it, with its errors, in one place.

squeue (live state), sacct (accounting, after the fact), `scontrol show job` (what Slurm is doing with
a job right now: requeue under way, time limit reached), `scontrol requeue` (the one order). Each
returns what Slurm answered — never what we hoped — and a command that cannot run (not installed, not
on PATH, controller unreachable) is an answer too, with Slurm's own words.

The states of many jobs are one squeue call (`squeue_states`) and one sacct call (taehv_slurm.sacct's
`sacct_records` of a list of jobs); taehv_slurm.jobstates shares those answers within the process.

`scontrol` is looked up once, where the job starts: the sbatch script exports its path as
TAEHV_SCONTROL before the cluster config's `setup:` lines run, so a setup line that replaces PATH
cannot take it away from the requeue that comes hours later. Inside a job, every command goes to the
job's Slurm relay (taehv_slurm.relay, named by TAEHV_SLURM_RELAY), which runs it in the batch script,
outside any container the ranks run in.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Job states after which a job does nothing more (Slurm's, plus PREEMPTED for a job not requeued).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                          "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
SUCCESS_STATES = frozenset({"COMPLETED"})
SCONTROL_ENV = "TAEHV_SCONTROL"  # scontrol's path on the nodes, found before the setup lines run
RELAY_ENV = "TAEHV_SLURM_RELAY"  # HOST:PORT:TOKEN of the job's Slurm relay (taehv_slurm.relay)
RELAY_CONNECT_S = 10.0
NO_SLURM_HINT = ("no Slurm here: use --local to run on this machine, "
                 "or set SLURM_CONF to your cluster's slurm.conf")
# What Slurm's commands say when they find no configuration (no slurm.conf, no DNS SRV record for configless).
_NO_CONFIG_MARKS = ("Could not establish a configuration source", "_establish_config_source",
                    "fetch_config: DNS SRV")


def no_slurm_reason(probe: bool = False) -> str | None:
    """Why Slurm cannot be used from here, in one line; None when it may be. Checked before asking Slurm
    (sbatch retries a missing SLURM_CONF for 60 s); probe: also ask `sinfo` whether it finds a
    configuration, with its output captured (sbatch would print its errors to the terminal)."""
    if shutil.which("sbatch") is None:
        return NO_SLURM_HINT
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        return (f"SLURM_CONF={conf} names no file: point it at your cluster's slurm.conf, "
                "or unset it (or use --local)")
    if probe and run(["sinfo", "-h", "-o", "%P"], timeout_s=30).error == NO_SLURM_HINT:
        return NO_SLURM_HINT
    return None


def says_no_slurm(text: str) -> bool:
    """Whether a Slurm command's error output means there is no Slurm configuration here."""
    return any(mark in text for mark in _NO_CONFIG_MARKS)


_MUNGE_ENCODE_FAILED = re.compile(r"Munge encode failed: (.+)")
# What a Slurm command gets where the controller dropped its request unanswered: what slurmctld does with a
# request whose munge credential it cannot verify (its log: "Munge decode failed: Invalid credential")
_DROPPED = "Zero Bytes were transmitted or received"


def munge_trouble(text: str) -> str | None:
    """One line where a Slurm command's error output says it could not sign its request with munge (munged
    not running on this machine, or its socket not inside this container), or that the controller dropped
    it unanswered (a munge key or clock other than the controller's), naming the fix; else None."""
    if match := _MUNGE_ENCODE_FAILED.search(text):
        return (f"Slurm's commands here cannot reach munged ({match.group(1).strip()}): start munged on this "
                "machine (`systemctl start munge`), or in a container mount the host's munge socket folder "
                "(e.g. `-v /run/munge:/run/munge`)")
    if _DROPPED in text:
        return (f"Slurm's controller dropped the request unanswered ({_DROPPED}), as it does when it cannot "
                "verify this machine's munge credential: a munge key other than the controller's (the same "
                "/etc/munge/munge.key on every host; in a container, mount the host's /run/munge instead of "
                "running a munged of its own) or a clock minutes off; `munge -n | ssh CONTROLLER unmunge` "
                "says which (Invalid credential: the key; Expired or Rewound credential: the clock)")
    return None


def says_unknown_job(text: str) -> bool:
    """Whether squeue's error means only that it lists none of the jobs asked about (every one of them
    ended long ago or never was): an answer, not a failure to get one."""
    return "Invalid job id" in text


def is_final(state: str) -> bool:
    return (state.split() or ["?"])[0] in FINAL_STATES


def is_success(state: str) -> bool:
    return (state.split() or ["?"])[0] in SUCCESS_STATES


@dataclass(frozen=True)
class Answer:
    """What a Slurm command answered: ok, its output, and the reason in one line when not ok."""

    ok: bool
    output: str = ""
    error: str = ""


def run(argv: Sequence[str], timeout_s: float = 60, survive_term: bool = False,
        cwd: str | os.PathLike | None = None, outside_job: bool = False) -> Answer:
    """Run a Slurm command — through the job's relay inside a job that has one, else here (`run_here`)."""
    relay = os.environ.get(RELAY_ENV)
    if relay:
        return relayed(relay, argv, timeout_s, survive_term, cwd, outside_job)
    return run_here(argv, timeout_s, survive_term, cwd, outside_job)


def relayed(relay: str, argv: Sequence[str], timeout_s: float, survive_term: bool,
            cwd: str | os.PathLike | None, outside_job: bool = False) -> Answer:
    """`argv` run by the job's Slurm relay (its own copy of the command, found where the batch script
    runs); an unreachable relay is an answer too."""
    host, port, token = relay.rsplit(":", 2)
    request = {"token": token, "argv": [os.path.basename(argv[0]), *argv[1:]], "timeout_s": timeout_s,
               "survive_term": survive_term, "cwd": None if cwd is None else str(cwd),
               "outside_job": outside_job}
    try:
        with socket.create_connection((host, int(port)), timeout=RELAY_CONNECT_S) as conn:
            conn.settimeout(timeout_s + RELAY_CONNECT_S)
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(conn.makefile("rb").readline() or b"null")
    except (OSError, ValueError) as err:
        return Answer(False, error=f"the job's Slurm relay on {host}:{port} did not answer ({err}): "
                                   "the batch script that runs it has ended")
    if not isinstance(reply, dict):
        return Answer(False, error=f"the job's Slurm relay on {host}:{port} closed without answering")
    return Answer(bool(reply.get("ok")), str(reply.get("output", "")), str(reply.get("error", "")))


def run_here(argv: Sequence[str], timeout_s: float = 60, survive_term: bool = False,
             cwd: str | os.PathLike | None = None, outside_job: bool = False) -> Answer:
    """Run a Slurm command; its failure (missing binary, non-zero exit, timeout) becomes an Answer.
    outside_job: without this job's own variables (`environ_outside_job`), for an sbatch from inside it.
    survive_term: the command ignores SIGTERM — for the commands a job runs on itself to requeue itself
    (`scontrol requeue`, `requeuehold` and what follows it): Slurm's SIGTERM to the job's processes on
    the requeue reaches them too, and would end them half-way (a requeue that happened, recorded as
    failed with exit code -15: seen on the testbed)."""
    # /bin/sh by its path: a job's setup lines may have replaced PATH (scontrol's own path was kept)
    command = ["/bin/sh", "-c", 'trap "" TERM; exec "$0" "$@"', *argv] if survive_term else list(argv)
    # SIGTERM blocked from the fork on (the child inherits the mask; the trap then discards it): a SIGTERM
    # that reached the shell before its trap ended `scontrol release` after a requeuehold on the testbed,
    # and left the job held for good.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if survive_term else None
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   cwd=cwd, env=environ_outside_job() if outside_job else None)
    except FileNotFoundError:
        return Answer(False, error=f"{argv[0]} not found (not installed here, or not on PATH)")
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return Answer(False, error=f"{os.path.basename(argv[0])} did not answer within {timeout_s:.0f} s")
    if process.returncode != 0:
        if says_no_slurm(stderr):
            return Answer(False, stdout, NO_SLURM_HINT)
        if trouble := munge_trouble(stderr):
            return Answer(False, stdout, trouble)
        lines = (stderr or stdout).strip().splitlines()
        return Answer(False, stdout, lines[-1].strip() if lines else f"exit code {process.returncode}")
    return Answer(True, stdout)


# Set by Slurm, the batch script or our entry point for this job alone: a job submitted from inside it with
# sbatch's --export=ALL would inherit them where Slurm does not set its own (SLURM_RESTART_COUNT, say).
JOB_ONLY_VARS = ("SUBMITIT_FOLDER", "TAEHV_STARTED_AT", "TAEHV_LAUNCH", "TAEHV_STEP_LOOP", RELAY_ENV)


def environ_outside_job() -> dict[str, str]:
    """This process's environment less what belongs to the job it runs in (SLURM_CONF stays)."""
    return {k: v for k, v in os.environ.items()
            if k not in JOB_ONLY_VARS and (k == "SLURM_CONF" or not k.startswith(("SLURM_", "SRUN_")))}


def scontrol() -> str | None:
    """scontrol's path: the one found when the job started (TAEHV_SCONTROL), else on PATH now. Inside a
    job with a relay, the path where the batch script runs (the relay runs it there)."""
    if os.environ.get(RELAY_ENV):
        return os.environ.get(SCONTROL_ENV) or None
    found = os.environ.get(SCONTROL_ENV) or shutil.which("scontrol")
    return found if found and os.access(found, os.X_OK) else None


def scontrol_missing(host: str) -> str | None:
    """Why this job could never requeue itself (one line with the fix), or None when scontrol is there:
    inside a job with a relay, the relay's scontrol is asked (where the batch script runs)."""
    relay = os.environ.get(RELAY_ENV)
    if (run(["scontrol", "--version"], timeout_s=30).ok if relay else scontrol() is not None):
        return None
    given, host = os.environ.get(SCONTROL_ENV), relay.rsplit(":", 2)[0] if relay else host
    where = f"{SCONTROL_ENV}={given} is not an executable" if given else f"scontrol is not on PATH on {host}"
    return (f"{where} where the job starts, so it could never requeue itself: "
            "put Slurm's bin folder on PATH for "
            f"jobs, or set {SCONTROL_ENV} in the cluster env to scontrol's path on the nodes")


def squeue_state(job_id: str) -> str | None:
    """The state the controller lists for the job (PENDING, RUNNING, ..., and for MinJobAge after it ended
    COMPLETED, FAILED, ...: on a cluster without accounting the only place a job's end shows), else None
    (taehv_slurm.jobstates: the answer shared by the process)."""
    from taehv_slurm import jobstates

    return jobstates.queue_states([job_id])[job_id]


def job_state(job_id: str) -> str | None:
    """Live state from squeue while the job is listed there, else its last state from accounting
    (taehv_slurm.jobstates: the answer shared by the process)."""
    from taehv_slurm import jobstates

    return jobstates.job_states([job_id])[job_id]


def squeue_answer(job_id: str) -> Answer:
    """squeue's own answer about one job now (`-o %T`), its error included ('Invalid job id')."""
    return run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], timeout_s=30)


def squeue_states(job_ids: Sequence[str]) -> dict[str, str] | Answer:
    """One squeue call: the state of each of the jobs the controller lists (the others are not keys), or
    the failed Answer where the controller did not answer. Array tasks are listed one by one (`-r`); an id
    Slurm does not know is left out."""
    answer = run(["squeue", "-h", "-t", "all", "-r", "-j", ",".join(job_ids), "-o", "%i %T"], timeout_s=30)
    if not answer.ok and not says_unknown_job(answer.error):
        return answer
    listed: dict[str, str] = {}
    for line in answer.output.splitlines() if answer.ok else []:
        job_id, _, state = line.strip().partition(" ")
        if state.strip():
            listed.setdefault(job_id, state.strip())
    return listed


def run_scontrol(*args: str, timeout_s: float = 60, survive_term: bool = False,
                 cwd: str | os.PathLike | None = None) -> Answer:
    """`scontrol ARGS` with the scontrol found when the job started (`scontrol()`); see `run`."""
    binary = scontrol()
    if binary is None:
        return Answer(False, error=f"scontrol not found (not on PATH, and ${SCONTROL_ENV} is not set)")
    return run([binary, *args], timeout_s=timeout_s, survive_term=survive_term, cwd=cwd)


def job_info(job_id: str, timeout_s: float = 30, survive_term: bool = False) -> dict[str, str] | Answer:
    """`scontrol show job -o` as {JobState, Reason, Restarts, EndTime, ...}, or the failed Answer."""
    answer = run_scontrol("show", "job", "-o", job_id, timeout_s=timeout_s, survive_term=survive_term)
    if not answer.ok:
        return answer
    return dict(re.findall(r"(\w+)=(\S*)", answer.output))


def past_its_end_time(info: Mapping[str, str], now: float) -> bool:
    """A RUNNING job (in `job_info`'s answer) whose EndTime has come: its time limit is here, whatever the
    controller has recorded so far. slurmstepd ends the job's steps at the limit by itself, and their SIGTERM
    can reach the ranks before slurmctld has set Reason=TimeLimit (seen on a loaded testbed). Only RUNNING:
    a cancelled or requeued job's EndTime becomes the moment it ended."""
    if info.get("JobState") != "RUNNING":
        return False
    try:
        end = datetime.datetime.fromisoformat(info.get("EndTime", "")).timestamp()  # the node's local time
    except ValueError:  # Unknown, None
        return False
    return now >= end


def seconds_left(info: Mapping[str, str], now: float) -> float | None:
    """Seconds until a RUNNING job's time limit (`job_info`'s EndTime), None when it has none or is not
    running."""
    if info.get("JobState") != "RUNNING":
        return None
    try:
        return datetime.datetime.fromisoformat(info.get("EndTime", "")).timestamp() - now
    except ValueError:  # Unknown, None: no limit
        return None


def kill_step(job_id: str, step_id: str) -> Answer:
    """`scancel --signal=KILL JOB.STEP`: every process of one job step ends at once, also a stopped one (a
    hung rank) — the job and its other steps go on. scancel is taken from beside the scontrol the job
    found when it started, else from PATH."""
    binary = scontrol()
    beside = os.path.join(os.path.dirname(binary), "scancel") if binary else ""
    scancel = beside if beside and os.access(beside, os.X_OK) else "scancel"
    return run([scancel, "--signal=KILL", f"{job_id}.{step_id}"], timeout_s=30)


def requeue(job_id: str, timeout_s: float = 60, hold: bool = False, survive_term: bool = False) -> Answer:
    """`scontrol requeue JOB` (`requeuehold` with `hold`): ok only when Slurm accepted it. A job that
    requeues itself passes `survive_term`: the command must outlive the SIGTERM the requeue sends."""
    return run_scontrol("requeuehold" if hold else "requeue", job_id, timeout_s=timeout_s,
                        survive_term=survive_term)


def update_job(job_id: str, survive_term: bool = False, **fields: str) -> Answer:
    """`scontrol update JobId=JOB KEY=VALUE ...` (e.g. ExcNodeList of a pending job)."""
    return run_scontrol("update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items()),
                        survive_term=survive_term)


def shrink_job(job_id: str, keep: Sequence[str]) -> Answer:
    """A running job keeps only the nodes `keep` (`scontrol update JobId=JOB NodeList=...`). scontrol
    writes scripts that reset the job's environment (slurm_job_JOB_resize.sh, .csh) into its working
    directory: a scratch one, not the user's."""
    with tempfile.TemporaryDirectory(prefix="taehv-resize-") as scratch:
        return run_scontrol("update", f"JobId={job_id}", f"NodeList={','.join(keep)}", cwd=scratch)


def expand_hosts(text: str | None) -> list[str]:
    """Slurm's host list text ('tb[1-2],gpu7', or '(null)') as names."""
    if not text or text == "(null)":
        return []
    import hostlist

    return list(hostlist.expand_hostlist(text))


def partition_size(partition: str) -> int:
    """Nodes in `partition` that sinfo lists (0 when it cannot tell)."""
    answer = run(["sinfo", "-h", "-p", partition, "-o", "%D"], timeout_s=30)
    return sum(int(n) for n in answer.output.split() if n.isdigit()) if answer.ok else 0


def refuses_requeue(error: str) -> bool:
    """Whether Slurm's answer to a requeue is the cluster's policy (requeue disabled or not permitted for
    this job), not a controller it could not reach."""
    text = error.lower()
    return "disabled" in text or "not permitted" in text or "access" in text


def requeue_fix(error: str) -> str:
    """What to do when a requeue was refused, from Slurm's answer."""
    text = error.lower()
    if "not found" in text:
        return "put Slurm's bin folder on PATH where jobs start (or set TAEHV_SCONTROL in the cluster env)"
    if ("unable to contact" in text or "did not answer" in text or "connection" in text
            or "configuration" in text):
        return "the Slurm controller was unreachable from the node; check `scontrol ping` there"
    if refuses_requeue(text):
        return ("the cluster does not allow this job to be requeued (JobRequeue=0 or --no-requeue); "
                "ask its admins")
    return "see Slurm's answer above"


def squeue_reason(job_id: str) -> str:
    """'still PENDING, reason Resources' for a job Slurm lists, else 'state unknown'."""
    answer = run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], timeout_s=30)
    if answer.ok and answer.output.strip():
        state, _, reason = answer.output.strip().partition(" ")
        return f"still {state}, reason {reason}"
    return "state unknown"


# ---------------------------------------------------------------------------------------- sinfo

# Node states a job can run on (sinfo %T, lower case, flags like '*' or '~' stripped).
USABLE_NODE_STATES = frozenset({"idle", "mixed", "allocated", "completing", "planned", "reserved"})


def sinfo(args: Sequence[str]) -> Answer:
    """sinfo's answer, with the reason in one line (and what to do) when it cannot give one."""
    if reason := no_slurm_reason():
        return Answer(False, error=reason)
    answer = run(["sinfo", *args], timeout_s=60)
    if answer.ok:
        return Answer(True, "\n".join(line for line in answer.output.splitlines() if line.strip()))
    if answer.error == NO_SLURM_HINT:
        return answer
    if "did not answer" in answer.error:
        return Answer(False, error="sinfo did not answer within 60 s: "
                                   "the Slurm controller is unreachable or overloaded")
    return Answer(False, error=f"sinfo failed: {answer.error}")


def submit_follow_up(script: str | os.PathLike, job_id: str, exclude: Sequence[str] = (),
                     cwd: str | os.PathLike | None = None) -> Answer:
    """`sbatch --parsable` of a job's own batch script as its next attempt: it starts once `job_id` ended in
    a failed state (afternotok: preempted, timed out, failed, cancelled), and is removed by Slurm if that job
    completes (--kill-on-invalid-dep); an array task's follow-up is an array of that one task. Without the
    job's own variables. Ok with the new job's id (ARRAY_TASK for an array task) as output."""
    array, _, task = job_id.partition("_")
    argv = ["sbatch", "--parsable", f"--dependency=afternotok:{job_id}", "--kill-on-invalid-dep=yes",
            *([f"--array={task}"] if task else []), *([f"--exclude={','.join(exclude)}"] if exclude else []),
            str(script)]
    answer = run(argv, timeout_s=60, survive_term=True, cwd=cwd, outside_job=True)
    if not answer.ok:
        return answer
    new = answer.output.strip().split(";")[0]
    return Answer(True, f"{new}_{task}" if task else new)


def site_requeues(config: Mapping[str, str]) -> bool:
    """Whether the cluster requeues preempted jobs (PreemptMode without CANCEL) and lets jobs be requeued
    (JobRequeue not 0), from `show_config`'s answer."""
    return "CANCEL" not in config.get("PreemptMode", "OFF").upper() and config.get("JobRequeue", "1") != "0"


def show_config(timeout_s: float = 30) -> dict[str, str] | Answer:
    """`scontrol show config` as {name: value} (AccountingStorageType, PreemptMode, JobRequeue, ...); the
    Answer when it failed."""
    answer = run_scontrol("show", "config", timeout_s=timeout_s)
    if not answer.ok:
        return answer
    pairs = (line.partition("=") for line in answer.output.splitlines())
    return {name.strip(): value.strip() for name, sep, value in pairs if sep}


def parse_gres(text: str) -> dict[str, int]:
    """'gpu:h100:8(S:0-1),gpu:2' → {'gpu': 10, 'gpu:h100': 8, ...}: count per name and per name:type."""
    counts: dict[str, int] = {}
    for item in re.split(r",(?![^(]*\))", text or ""):
        item = re.sub(r"\(.*?\)", "", item).strip()
        if not item or item == "(null)":
            continue
        parts = item.split(":")
        count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        name = parts[0]
        counts[name] = counts.get(name, 0) + count
        if len(parts) == 3:
            typed = f"{name}:{parts[1]}"
            counts[typed] = counts.get(typed, 0) + count
    return counts


def limit_minutes(limit: str) -> int | None:
    """Slurm's time limit text in minutes: 'infinite', 'D-HH[:MM[:SS]]', 'HH:MM:SS', 'MM:SS' or 'MM'."""
    if limit in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days, dash, rest = limit.partition("-") if "-" in limit else ("0", "", limit)
    parts = [int(p) for p in rest.split(":")]
    if dash or len(parts) == 3:  # hours first
        hours, minutes = parts[0], parts[1] if len(parts) > 1 else 0
    else:  # minutes first (MM or MM:SS)
        hours, minutes = 0, parts[0]
    return int(days) * 1440 + hours * 60 + minutes

