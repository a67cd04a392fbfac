"""The job steps of one Slurm allocation: where the ranks run, and where they run again after a fault.

A training job holds its allocation — the nodes it trains on, plus its spare nodes — and its batch script
starts the ranks as a job step (`srun`) on the nodes this module names. When a step ends in a fault (a rank
failed, hung or was killed), `RequeueableTask.after_ranks` decides, in the batch script, whether the ranks
start again inside the allocation — on the healthy nodes, a spare taking a failed node's place, or on fewer
nodes at the same effective batch — and writes the next step's placement here; the script starts it without
going back to the queue. The loop in the script (taehv_slurm.executor):

    python -m taehv_slurm.runtime.steps first FOLDER NODES TASKS_PER_NODE MIN_NODES   # the first step's nodes
    while :; do srun $(cat FOLDER/<job>_srun_args) ... entry FOLDER RUN_DIR
                entry --after $? FOLDER RUN_DIR || [ $? = 75 ] && next launch ... ; done

That first line is the one way the node count reaches a job: `first` keeps the placement beside the step's
flags (`<job>_placement.json`), and a restart reads it there. Only the submitting side writes that loop
(jobs queued by older code run one step, as before, or name their placement in their pickle).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from taehv_slurm.common.runfolder import write_text_atomic
from taehv_slurm.runtime.distenv import expand_nodelist, slurm_job_id

LAUNCH_ENV = "TAEHV_LAUNCH"  # 0 for the allocation's first step, +1 for each restart inside it
STEP_LOOP_ENV = "TAEHV_STEP_LOOP"  # set by a batch script that restarts steps: the ranks leave that to it
# set by the batch script once Slurm sent it SIGTERM: Slurm is ending the job (a requeue, a preemption, a
# cancel), so nothing is restarted in an allocation that is going away
JOB_ENDING_ENV = "TAEHV_JOB_ENDING"
RESTART_EXIT_CODE = 75  # `entry --after`'s answer: start the ranks again (EX_TEMPFAIL)
# The job's exit status once its next attempt is a follow-up job (taehv_slurm.followup): not 0, so that the
# follow-up's afternotok dependency holds; sacct shows the job FAILED with this code.
FOLLOW_UP_EXIT_CODE = 76


def handed_over(events: list[dict]) -> bool:
    """Whether these events of one attempt end it with a follow-up job taking over."""
    return any(e["event"] == "requeue" and e.get("follow_up") for e in events)


@dataclass(frozen=True)
class Placement:
    """How many nodes a run trains on, with how many tasks each, and the fewest it may shrink to."""

    nodes: int
    tasks_per_node: int
    min_nodes: int

    def choose(self, allocation: Sequence[str], excluded: Sequence[str]) -> list[str] | None:
        """The nodes of the next step: `nodes` healthy ones in the allocation's order (a spare takes a failed
        node's place), else every healthy one if that is at least `min_nodes` (the run shrinks), else None."""
        healthy = [n for n in allocation if n not in set(excluded)]
        if len(healthy) >= self.nodes:
            return healthy[:self.nodes]
        return healthy if len(healthy) >= max(1, self.min_nodes) else None

    def srun_args(self, nodes: Sequence[str]) -> str:
        """srun's flags for a step of the ranks on `nodes`."""
        return (f"--nodes={len(nodes)} --ntasks={len(nodes) * self.tasks_per_node} "
                f"--ntasks-per-node={self.tasks_per_node} --nodelist={','.join(nodes)}")


def in_step_loop(environ: Mapping[str, str] | None = None) -> bool:
    """This process runs under a batch script that starts the ranks again after a fault."""
    return (os.environ if environ is None else environ).get(STEP_LOOP_ENV) == "1"


def launch_number(environ: Mapping[str, str] | None = None) -> int:
    """Which step of its allocation this is: 0 first, +1 per restart inside the allocation."""
    return int((os.environ if environ is None else environ).get(LAUNCH_ENV) or 0)


def allocation_nodes(environ: Mapping[str, str] | None = None) -> list[str]:
    """The job's nodes in Slurm's order (SLURM_JOB_NODELIST), [] outside a Slurm job."""
    nodelist = (os.environ if environ is None else environ).get("SLURM_JOB_NODELIST")
    return expand_nodelist(nodelist) if nodelist else []


def args_path(folder: str | os.PathLike, job_id: str) -> Path:
    """Where the batch script reads the next step's srun flags."""
    return Path(folder) / f"{job_id}_srun_args"


def placement_path(folder: str | os.PathLike, job_id: str) -> Path:
    """Where `first` keeps the job's placement for its restarts."""
    return Path(folder) / f"{job_id}_placement.json"


def read_placement(folder: str | os.PathLike, job_id: str) -> Placement | None:
    """The placement `first` kept for this job, None where it kept none (a script of older code)."""
    try:
        return Placement(**json.loads(placement_path(folder, job_id).read_text()))
    except FileNotFoundError:
        return None


def write_step(folder: str | os.PathLike, job_id: str, placement: Placement, nodes: Sequence[str]) -> None:
    # whole or not at all: the batch script reads it with $(cat ...) the moment this step ends
    write_text_atomic(args_path(folder, job_id), placement.srun_args(nodes) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """`first FOLDER NODES TASKS_PER_NODE [MIN_NODES]`: the job's placement kept for its restarts, and the
    first step's flags, on the first NODES nodes (MIN_NODES, NODES by default: a script of older code)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (4, 5) or args[0] != "first":
        print("usage: python -m taehv_slurm.runtime.steps first FOLDER NODES TASKS_PER_NODE [MIN_NODES]",
              file=sys.stderr)
        return 2
    folder, counts = args[1], [int(a) for a in args[2:]]
    placement = Placement(counts[0], counts[1], counts[2] if len(counts) == 3 else counts[0])
    nodes = placement.choose(allocation_nodes(), ())
    if nodes is None:
        print(f"[taehv] the allocation ({os.environ.get('SLURM_JOB_NODELIST')}) has fewer than "
              f"{placement.nodes} nodes", file=sys.stderr)
        return 1
    job_id = slurm_job_id(os.environ)
    write_text_atomic(placement_path(folder, job_id), json.dumps(asdict(placement)) + "\n")
    write_step(folder, job_id, placement, nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
