"""build_submission: the Ray job-submission request that starts the trainer on the head (real clusters).

POSTed to the head's dashboard (`/api/jobs/`) with a submission id fixed by (job uid, attempt): a
second POST for the same attempt is refused by Ray, so an operator restarted at any point never
starts a second trainer. The spec travels inside the entrypoint (base64 of the PPOJob manifest),
a snapshot taken when the attempt starts. The trainer's output also goes to the head container's
own stdout (its PID 1's), so `kubectl logs` of the head shows the step lines beside Ray's job log.
The trainer writes its pid to `names.TRAINER_PID_FILE`, where the head's preStop hook finds it.
Pure.
"""

from __future__ import annotations

import base64
import shlex
from typing import Any

import yaml

from ppo_operator import names
from ppo_operator.builders.common import BuildOptions
from ppo_operator.job import Job
from ppojob_api.vocabulary import API_VERSION, KIND

DASHBOARD_PORT = 8265
CONTAINER_LOG = "/proc/1/fd/1"  # the head container's stdout, which `kubectl logs` reads


def trainer_manifest(job: Job) -> dict[str, Any]:
    """The PPOJob manifest the trainer reads as its CONFIG."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": job.name, "namespace": job.namespace, "uid": job.uid},
        "spec": dict(job.raw_spec),
    }


def trainer_args(
    *, config: str, run_dir: str, resume: bool, options: BuildOptions, address: str | None = None,
    pid_file: str | None = None,
) -> list[str]:
    """`ppo-train CONFIG [--address A] --run-dir DIR [--pid-file F] [--resume]`: later attempts resume
    from the checkpoint."""
    joined = ["--address", address] if address else []
    signalled = ["--pid-file", pid_file] if pid_file else []
    return [*options.trainer_command, config, *joined, "--run-dir", run_dir, *signalled, *(["--resume"] if resume else [])]


def should_resume(job: Job, attempt: int) -> bool:
    """The trainer continues from the latest checkpoint: on every attempt after the first, and on the
    first once Kueue has evicted the job (its RayCluster, admitted again, starts the trainer again)."""
    return attempt > 0 or bool(job.status.get("evictions"))


def dashboard_url(job: Job, attempt: int) -> str:
    """The head's dashboard through the Service KubeRay makes for it."""
    return f"http://{names.raycluster_name(job.name, attempt)}-head-svc.{job.namespace}.svc:{DASHBOARD_PORT}"


def build_submission(job: Job, *, attempt: int, run_dir: str, options: BuildOptions) -> dict[str, Any]:
    config = names.trainer_config_path(job.uid, attempt)
    encoded = base64.b64encode(yaml.safe_dump(trainer_manifest(job), sort_keys=True).encode()).decode()
    args = trainer_args(config=config, run_dir=run_dir, resume=should_resume(job, attempt), options=options, address="auto",
                        pid_file=names.TRAINER_PID_FILE)
    # Ray runs the entrypoint with /bin/sh; bash's process substitution copies the output to the
    # container's log while `exec` keeps the trainer's own exit status for Ray.
    mirrored = f"exec > >(tee -a {CONTAINER_LOG}) 2>&1; exec {shlex.join(args)}"
    entrypoint = f"echo {encoded} | base64 -d > {config} && exec bash -c {shlex.quote(mirrored)}"
    return {
        "submission_id": names.submission_id(job.uid, attempt),
        "entrypoint": entrypoint,
        "runtime_env": {"env_vars": {"PPOJOB_ATTEMPT": str(attempt)}},
        "metadata": {"ppojob": f"{job.namespace}/{job.name}", "attempt": str(attempt)},
    }
