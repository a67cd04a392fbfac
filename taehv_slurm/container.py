"""Ranks in a container image: how each runtime starts a rank, and what is checked before the queue.

The cluster config's `container_image` runs every rank inside an image (`container_runtime`):

- `pyxis` (Pyxis + enroot): srun's own flags, `srun --container-image=IMAGE --container-mounts=...`;
  IMAGE is an enroot squashfs file or a registry reference (`nvcr.io#nvidia/pytorch:24.05-py3`).
- `apptainer`: each rank's command becomes `apptainer exec --bind ... [--nv] IMAGE python ...`; IMAGE is an
  .sif file, a sandbox folder or a URI (`docker://...`, `oras://...`).
- `charliecloud`: `ch-run -b SRC:DST ... IMAGE -- python ...`; IMAGE is an unpacked image folder.

Only the ranks run inside. The batch script's own steps — the Slurm relay (taehv_slurm.relay) that runs
every Slurm command a fault needs, the placement of each job step, the decision after it — run outside,
with the interpreter of `python`; the ranks use the image's `container_python`. The ranks work in the
folder the job was submitted from, as outside, so `container_mounts` must bring the run folders (and the
data) in at their own paths.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from taehv_slurm.common.config import ClusterConfig

RUNTIMES = ("pyxis", "apptainer", "charliecloud")
APPTAINER_SCHEMES = ("docker://", "docker-daemon:", "docker-archive:", "oci:", "oci-archive:", "oras://",
                     "library://", "shub://", "http://", "https://")
# enroot's image reference: [USER@][REGISTRY#]IMAGE[:TAG][@DIGEST]
_ENROOT_REFERENCE = re.compile(r"^([\w.-]+@)?([\w.-]+(:\d+)?#)?[a-z0-9]+([._/-][a-z0-9]+)*"
                               r"(:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
WORKDIR = '"$PWD"'  # the batch script's folder, where the job was submitted from: the ranks start there too


def srun_flags(cluster: ClusterConfig) -> str:
    """srun's own flags for the ranks' job step ('' unless Pyxis runs them), as shell words."""
    if not cluster.container_image or cluster.container_runtime != "pyxis":
        return ""
    flags = [f"--container-image={cluster.container_image}"]
    if cluster.container_mounts:
        flags.append(f"--container-mounts={','.join(cluster.container_mounts)}")
    return " " + shlex.join(flags) + f" --container-workdir={WORKDIR}"


def rank_command(cluster: ClusterConfig, command: str) -> str:
    """Each rank's shell command, inside the image where Apptainer or Charliecloud starts it."""
    image = cluster.container_image
    if not image or cluster.container_runtime == "pyxis":
        return command
    if cluster.container_runtime == "apptainer":
        words = ["apptainer", "exec", *(["--nv"] if cluster.gpus_per_node > 0 else [])]
        if cluster.container_mounts:
            words += ["--bind", ",".join(cluster.container_mounts)]
        return f"{shlex.join(words)} --pwd {WORKDIR} {shlex.quote(image)} {command}"
    words = ["ch-run", *(w for m in cluster.container_mounts for w in ("-b", m))]
    return f"{shlex.join(words)} --cd={WORKDIR} {shlex.quote(image)} -- {command}"


def script_lines(cluster: ClusterConfig) -> list[str]:
    """The batch script's lines before the ranks start: ch-run refuses to start without $USER, which a job's
    environment need not hold."""
    if cluster.container_image and cluster.container_runtime == "charliecloud":
        return ['export USER="${USER:-$(id -un)}"']
    return []


def ranks_python(cluster: ClusterConfig, python: str) -> str:
    """The interpreter that starts the ranks: the image's inside a container, else `python`."""
    return cluster.container_python if cluster.container_image else python


def image_problem(cluster: ClusterConfig) -> str | None:
    """Why the runtime could not start `container_image` (one line with the fix), or None."""
    image, runtime = cluster.container_image, cluster.container_runtime
    if not image:
        return None
    if runtime == "apptainer" and image.startswith(APPTAINER_SCHEMES):
        return None if image.split(":", 1)[1].strip("/") else f"container_image {image!r} names no image"
    looks_like_path = image.startswith(("/", "./", "../", "~")) or runtime != "pyxis" \
        or image.endswith((".sqsh", ".squashfs"))
    if looks_like_path:
        path = Path(image).expanduser()
        if not path.exists():
            return (f"container_image {image} does not exist (on this machine, where the nodes must see it "
                    "too): build or copy the image there, or fix the path")
        if runtime == "charliecloud" and not path.is_dir():
            return f"container_image {image} is not a folder: Charliecloud runs an unpacked image folder"
        return None
    first = image.split("#")[0].split("/")[0]
    if "#" not in image and "/" in image and ("." in first or ":" in first):
        return (f"container_image {image!r}: Pyxis separates a registry with '#' "
                f"(write {first}#{image.split('/', 1)[1]})")
    if not _ENROOT_REFERENCE.match(image):
        return (f"container_image {image!r} is neither an existing squashfs file nor an image reference "
                "of the form [USER@][REGISTRY#]IMAGE[:TAG]")
    return None


def mounts_problem(cluster: ClusterConfig, job_dir: str | os.PathLike) -> str | None:
    """Why the ranks would not see what they need inside the image (one line with the fix), or None: every
    mount's source must exist, and the run folders must appear inside at their own path."""
    if not cluster.container_image:
        return None
    same_path = []  # folders that appear inside at their own path
    for mount in cluster.container_mounts:
        source, _, rest = mount.partition(":")
        if not Path(source).exists():
            return (f"container_mounts: {source} does not exist (on this machine, where the nodes must see "
                    "it too): fix the path or remove the mount")
        if Path(os.path.abspath(source)) == Path(rest.split(":")[0] or source):
            same_path.append(Path(os.path.abspath(source)))
    if cluster.container_runtime == "apptainer":  # Apptainer's own default binds
        same_path += [Path.home(), Path.cwd(), Path("/tmp")]
    if cluster.container_runtime == "charliecloud" and Path(cluster.container_image).is_dir():
        image = Path(cluster.container_image)
        missing = [m.split(":")[1] for m in cluster.container_mounts
                   if not (image / m.split(":")[1].lstrip("/")).is_dir()]
        if missing:
            return (f"container_mounts: {missing[0]} is no folder in the image {image}: Charliecloud binds "
                    f"only onto folders the image has (mkdir -p {image}{missing[0]}, or rebuild the image "
                    "with it)")
    runs = Path(os.path.abspath(job_dir))
    if not any(runs == t or t in runs.parents for t in same_path):
        return (f"the run folders ({runs}) are not mounted at their own path inside the container: add "
                f"'{runs}:{runs}' (or a folder above it) to container_mounts")
    return None
