"""Prepare training data on the cluster: teacher latents for every video window, stored in shards.

    taehv prepare --data videos/ --out prepared/ --teacher-path hv-vae/ --nodes 4   # index here, submit
    taehv prepare --data videos/ --out prepared/ --teacher-path hv-vae/ --dry-run  # the job, nothing run
    taehv prepare --data videos/ --out prepared/ --teacher-path random:tiny --frames 8 --height 64 \\
        --width 64 --local                                                          # run here, then verify
    taehv prepare --verify --out prepared/                                       # merge index.csv, check

Windows are the training windows (VideoFolderClips); shards hold --shard-size windows each. Every GPU
rank of one job takes every world_size-th unfinished shard. Submitting again into the same --out with
the same settings resumes it (finished shards are skipped); a requeued job does the same by itself.
Train from the result with `--set data.source=prepared --set data.path=OUT` (teacher.kind: none).
Imports torch only to index the videos for a real submission (not for --help, --dry-run or --verify).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

from taehv_slurm.backends import backend_named
from taehv_slurm.cli import watch
from taehv_slurm.cli.conventions import (
    EXIT_DONE,
    EXIT_FAILED,
    add_cluster_flags,
    load_cluster_from_args,
    one_line_errors,
    stopped_exit_code,
    terminate_as_interrupt,
)
from taehv_slurm.common.config import ClusterConfig, ConfigError, split_overrides
from taehv_slurm.common.messages import command
from taehv_slurm.common.runfolder import JobDir
from taehv_slurm.common.security import make_private_dir
from taehv_slurm.common.typed_yaml import parse_set_args
from taehv_slurm.executor import SubmissionError, sbatch_preview
from taehv_slurm.handle import JobHandle
from taehv_slurm.slurm import is_success
from taehv_slurm.trainer.manifest import PrepareError, PrepareSettings, check_out, count_videos, index_windows
from taehv_slurm.trainer.shards import finished_shards, verify
from taehv_slurm.training import submit_prepare


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog=command("prepare"), description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[1])
    p.add_argument("--data", help="folder of videos (searched recursively: .mp4 .webm .mkv .mov)")
    p.add_argument("--out",
                   help="folder for the shards and the index (new, or one this command prepared before)")
    p.add_argument("--verify", action="store_true",
                   help="only check --out and write its index.csv; submit nothing")
    g = p.add_argument_group("clips and teacher (must match on a resubmission)")
    g.add_argument("--frames", type=int, default=12, help="frames per window, a multiple of 4 (default 12)")
    g.add_argument("--height", type=int, default=480, help="clip height, a multiple of 8 (default 480)")
    g.add_argument("--width", type=int, default=720, help="clip width, a multiple of 8 (default 720)")
    g.add_argument("--stride", type=int,
                   help="frames between window starts (default --frames: no overlap, as training)")
    g.add_argument("--shard-size", type=int, default=32,
                   help="windows per shard file (default 32, ≈400 MB at 12×480×720)")
    g.add_argument("--teacher-kind", default="hunyuanvideo", help="hunyuanvideo (default), cogvideox or wan")
    g.add_argument("--teacher-path",
                   help="local diffusers VAE folder (config.json + weights), or random:tiny for tests")
    g.add_argument("--scaling-factor", type=float,
                   help="latent scale (default: the VAE config's, 0.476986 for HunyuanVideo)")
    g = p.add_argument_group("job")
    add_cluster_flags(g, local=True, set_help="override a cluster key, e.g. --set qos=high")
    g.add_argument("--batch", type=int, default=2,
                   help="clips per teacher call (default 2: as fast as 4 compiled, half the memory; "
                        "docs/benchmarks.md)")
    g.add_argument("--workers", type=int,
                   help="decoding processes per rank (default: cpus_per_task − 1 on GPUs, 0 on CPU)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the teacher's encoder on GPUs (default on: 1.9x eager on an H100; "
                        "compiled once into the job folder's compile cache, reused by every shard job and "
                        "requeue)")
    g.add_argument("--name",
                   help="run folder name under the cluster's job_dir (default prepare-<out>-<time>)")
    g.add_argument("--dry-run", action="store_true",
                   help="check the inputs, print the job and its sbatch script; run nothing")
    g.add_argument("--follow", action="store_true",
                   help="stream rank 0's log until the job ends, then verify")
    g.add_argument("--local", action="store_true",
                   help="run on this machine (local backend, no Slurm), then verify")
    return p


def load_cluster_for(args: argparse.Namespace) -> ClusterConfig:
    cluster_over, train_over = split_overrides(parse_set_args(args.set))
    if train_over:
        raise ConfigError(f"--set {next(iter(train_over))}: jobs.prepare takes cluster keys only; "
                          "clip and teacher settings are flags (--frames, --teacher-path, ...)")
    cluster = load_cluster_from_args(args, cluster_over)
    if "name" not in cluster_over:  # the Slurm job name: tell preparation jobs from training in squeue
        cluster = dataclasses.replace(cluster, name=f"{cluster.name}-prepare")
    return cluster


def settings_from(args: argparse.Namespace) -> PrepareSettings:
    if not args.data:
        raise PrepareError("--data is missing: pass the folder of videos to prepare")
    if not args.out:
        raise PrepareError("--out is missing: pass a folder for the shards (new, or one prepared before with "
                           "these settings)")
    return PrepareSettings(args.data, args.frames, args.height, args.width, args.stride, args.shard_size,
                           args.teacher_kind, args.teacher_path or "", args.scaling_factor).validate()


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")  # the indexer's skipped files
    if args.verify:
        if not args.out:
            raise PrepareError("--verify needs --out: the prepared folder to check")
        return report_verify(Path(args.out))
    settings = settings_from(args)
    cluster = load_cluster_for(args)
    out = Path(args.out).expanduser()
    manifest = check_out(out, settings)
    run_name = args.name or f"prepare-{out.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"

    if args.dry_run:
        print(f"job: {cluster.backend} backend, {cluster.nodes} node(s) × {cluster.tasks_per_node} ranks = "
              f"{cluster.world_size} ranks, gres {cluster.gres_request or 'none'}, "
              f"{cluster.cpus_per_task} CPUs/rank, "
              f"time {cluster.time_min} min, device {cluster.task_device()}")
        if manifest is not None:
            done = len(finished_shards(out))
            print(f"resume {out}: {manifest.describe()}; {done} of {manifest.num_shards} shards done")
        else:
            videos = sum(1 for _ in count_videos(Path(settings.data)))
            print(f"new preparation in {out}: {videos} video files in {settings.data}; "
                  f"{settings.frames}×{settings.height}×{settings.width} windows, stride {settings.stride}, "
                  f"{settings.shard_size} per shard; teacher "
                  f"{settings.teacher_kind} {settings.teacher_path} (windows are counted when you submit)")
        if backend_named(cluster.backend).writes_sbatch_script:
            folder = JobDir(cluster.job_dir).run(run_name).submitit
            print(f"\nsbatch script ({folder}/):\n{sbatch_preview(cluster, folder)}")
        return 0

    if reason := backend_named(cluster.backend).unavailable_reason():
        raise SubmissionError(reason)  # before the videos are indexed into --out
    if manifest is None:
        make_private_dir(out, cluster.group)
        print(f"indexing {settings.data} ...", flush=True)
        manifest = index_windows(settings)
        manifest.write(out)
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(manifest.skipped.items())) or "none"
        print(f"indexed in {manifest.index_seconds:.1f} s: {manifest.describe()}; skipped files: {skipped}")
    else:
        done = len(finished_shards(out))
        print(f"resuming {out}: {done} of {manifest.num_shards} shards done (window list as indexed on "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(manifest.created))}; "
              "new videos need a new --out)")
    handle = submit_prepare(cluster, out, manifest.num_shards, run_name, args.batch, args.workers,
                            args.compile)
    print(f"submitted job {handle.job_id}: {cluster.nodes} node(s) × {cluster.tasks_per_node} ranks, "
          f"run folder {handle.run_dir}")
    print(f"follow: {command('logs')} {handle.job_id} --follow --job-dir {cluster.job_dir}")
    print(f"verify: {command('prepare')} --verify --out {out}")
    backend = backend_named(cluster.backend)
    if not (args.local or args.follow or backend.runs_here):
        return 0
    return follow_and_verify(handle, backend.cancel_on_interrupt, out)


def follow_and_verify(handle: JobHandle, stop_on_interrupt: bool, out: Path) -> int:
    """Rank 0's log until the job ends, then the verified folder. Ctrl-C or SIGTERM stops a job of this
    machine (its finished shards are kept; the same command resumes) and only stops following another."""
    with terminate_as_interrupt():
        state, stopped = watch.follow_to_the_end(handle, stop_on_interrupt=stop_on_interrupt, bar=False)
    if stopped is not None and not stop_on_interrupt:
        # it only stopped following: the job runs on (the line printed says how to follow it)
        return stopped_exit_code(stopped)
    print(f"job {handle.job_id} ended: {state}")
    if stopped is not None:
        print(f"stopped: the shards written are kept; the same command resumes from them (verify: "
              f"{command('prepare')} --verify --out {out})", file=sys.stderr)
        return stopped_exit_code(stopped)
    code = report_verify(out)
    if not is_success(state):
        print(watch.failure_line(handle, state), file=sys.stderr)
        return EXIT_FAILED
    return code


def report_verify(out: Path) -> int:
    report = verify(out)
    print(report.table())
    if report.ok:
        frames, height, width = report.spec
        print(f"train from it: {command('submit')} --set data.source=prepared --set data.path={out} --set "
              f"data.frames={frames} --set data.height={height} --set data.width={width} "
              "--set teacher.kind=none")
    return EXIT_DONE if report.ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
