"""build_ray_token_secret: the job's Ray token, and the environment that turns Ray's token auth on.

Ray (>= 2.52) authenticates every gRPC call between its processes and every dashboard request
(job submission is running code) when RAY_AUTH_MODE=token; each process reads the token from
RAY_AUTH_TOKEN. KubeRay v1.5.0 has no option of its own for it, so the job has a Secret holding a
random token, and every Ray container reads it from there (KubeRay copies the container's env to
the workers' wait-gcs-ready init container, which then passes too). The operator sends the same
token as `Authorization: Bearer <token>` (launchers/ray_jobs.py). Pure; the caller draws the token.
"""

from __future__ import annotations

from typing import Any

from ppo_operator import names
from ppo_operator.builders.common import child_metadata
from ppo_operator.job import Job

ENV_RAY_AUTH_MODE = "RAY_AUTH_MODE"
ENV_RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_TOKEN_KEY = "token"
"""The Secret's key holding the token."""


def build_ray_token_secret(job: Job, *, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(job, names.ray_token_secret_name(job.name)),
        "type": "Opaque",
        "stringData": {RAY_TOKEN_KEY: token},
    }


def ray_token_env(job: Job) -> list[dict[str, Any]]:
    """Token auth on, with the job's token from its Secret (what every Ray container gets)."""
    return [
        {"name": ENV_RAY_AUTH_MODE, "value": "token"},
        {
            "name": ENV_RAY_AUTH_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": names.ray_token_secret_name(job.name), "key": RAY_TOKEN_KEY}},
        },
    ]
