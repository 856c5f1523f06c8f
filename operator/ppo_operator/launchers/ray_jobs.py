"""Real clusters: the trainer is a Ray job submitted to the head's dashboard (job-submission API).

The submission id is fixed by (job uid, attempt), so a resubmission after an operator restart is
refused by Ray instead of starting a second trainer; the job lives in the Ray cluster, so it
survives the operator; a submission left unanswered is sent again under the same id (Ray takes it
once). Its state (PENDING/RUNNING/SUCCEEDED/FAILED/STOPPED) is read from
`GET /api/jobs/<id>`: a driver that died is a failure here, not "Running". Every request carries
the job's Ray token (`Authorization: Bearer`, as Ray's dashboard checks it), read once per job
from the job's Secret and kept in memory. Depends on aiohttp and `kube`.
"""

from __future__ import annotations

import asyncio
import base64
import time

import aiohttp

from ppo_operator import names
from ppo_operator.builders.common import BuildOptions
from ppo_operator.builders.ray_token import RAY_TOKEN_KEY
from ppo_operator.builders.submission import build_submission, dashboard_url
from ppo_operator.job import Job
from ppo_operator.kube import SECRETS, Kube, KubeError
from ppo_operator.observed import TrainerRecord, TrainerState
from ppo_operator.plan import PODS, RAYCLUSTERS
from ppojob_api.vocabulary import LABEL_JOB_NAME

RETRY_S = 1.0
"""The pause before a submission is sent again (unanswered, or the head's job agent not there yet)."""
DELETED_JOB_GRACE_S = 1
"""The grace period of a deleted job's Ray pods: their preStop hook is cut short, no checkpoint."""
STATES = {
    "PENDING": TrainerState.RUNNING,
    "RUNNING": TrainerState.RUNNING,
    "SUCCEEDED": TrainerState.SUCCEEDED,
    "FAILED": TrainerState.FAILED,
    "STOPPED": TrainerState.FAILED,
}


class RayJobsLauncher:
    poll_seconds = 15.0

    def __init__(self, *, kube: Kube, options: BuildOptions, run_dir: str | None = None, url_of=dashboard_url,
                 timeout_s: float = 10, agent_wait_s: float = 60):
        self.kube, self.options, self.run_dir, self.url_of = kube, options, run_dir, url_of
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.agent_wait_s = agent_wait_s
        """How long a submission waits for a just-started head's job agent to register."""
        self._tokens: dict[str, str] = {}
        """Job uid -> the job's Ray token, as its Secret holds it."""

    async def _auth(self, job: Job) -> dict[str, str]:
        """The header Ray's dashboard wants with the job's token (one read of its Secret per job)."""
        token = self._tokens.get(job.uid)
        if token is None:
            secret = await self.kube.get(SECRETS, job.namespace, names.ray_token_secret_name(job.name))
            token = self._tokens[job.uid] = base64.b64decode(secret["data"][RAY_TOKEN_KEY]).decode()
        return {"Authorization": f"Bearer {token}"}

    async def observe(self, job: Job, attempt: int) -> TrainerRecord:
        submission = names.submission_id(job.uid, attempt)
        try:
            auth = await self._auth(job)
        except KubeError as exc:
            return TrainerRecord(TrainerState.UNKNOWN, submission, f"the job's Ray token is unreadable: {exc}")
        try:
            async with (
                aiohttp.ClientSession(timeout=self.timeout, headers=auth) as session,
                session.get(f"{self.url_of(job, attempt)}/api/jobs/{submission}") as response,
            ):
                if response.status == 404:
                    return TrainerRecord(TrainerState.NOT_STARTED, "", "not submitted")
                response.raise_for_status()
                info = await response.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return TrainerRecord(TrainerState.UNKNOWN, submission, f"dashboard unreachable: {exc}")
        state = STATES.get(info.get("status", ""), TrainerState.UNKNOWN)
        return TrainerRecord(state, submission, f"Ray job {info.get('status')}: {info.get('message') or ''}".strip())

    async def launch(self, job: Job, attempt: int) -> TrainerRecord:
        spec, _ = job.parse()
        run_dir = self.run_dir or (spec.checkpoint.path if spec else "/checkpoints")
        payload = build_submission(job, attempt=attempt, run_dir=run_dir, options=self.options)
        submission = payload["submission_id"]
        deadline = time.monotonic() + self.agent_wait_s
        async with aiohttp.ClientSession(timeout=self.timeout, headers=await self._auth(job)) as session:
            while True:
                try:
                    async with session.post(f"{self.url_of(job, attempt)}/api/jobs/", json=payload) as response:
                        status, text = response.status, await response.text()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # No answer, yet Ray may have taken it: the head forwards a submission to its job
                    # agent, whose first one starts the agent's own Ray driver (seconds on a loaded
                    # machine). Sent again under the same id, it is taken or refused as a duplicate:
                    # the trainer starts once either way.
                    if time.monotonic() >= deadline:
                        return TrainerRecord(TrainerState.UNKNOWN, submission,
                                             f"submission unanswered ({type(exc).__name__}); looked up next pass")
                    await asyncio.sleep(RETRY_S)
                    continue
                # A head whose dashboard answers before its job agent has registered says so ("No
                # available agent to submit job, please try again later"): not a refusal, a moment early.
                if status >= 500 and "no available agent" in text.lower() and time.monotonic() < deadline:
                    await asyncio.sleep(RETRY_S)
                    continue
                break
        if status >= 400 and "already exists" not in text:
            raise RuntimeError(f"Ray job submission refused ({status}): {text[:300]}")
        return TrainerRecord(TrainerState.RUNNING, submission, "submitted")

    async def stop_others(self, job: Job, keep_attempt: int | None) -> list[int]:
        return []  # an older attempt's Ray job dies with its RayCluster, which the operator deletes

    async def forget(self, job: Job) -> None:
        """The job is deleted: its Ray pods go at once. Their grace period is for a stop the job comes
        back from (a checkpoint nobody will read is not waited for); the garbage collector, which
        deletes them with the job, would give it to them."""
        self._tokens.pop(job.uid, None)
        selector = f"{LABEL_JOB_NAME}={names.job_label_value(job.name)}"
        clusters = await self.kube.list(RAYCLUSTERS, job.namespace, selector)
        # A job created since under the same name has clusters of its own, owned by its own uid.
        others = {c["metadata"]["uid"] for c in clusters
                  if job.uid not in {o.get("uid") for o in c["metadata"].get("ownerReferences", [])}}
        for pod in await self.kube.list(PODS, job.namespace, selector):
            owners = {o.get("uid") for o in pod["metadata"].get("ownerReferences", [])}
            if not owners & others:
                await self.kube.ensure_deleted(PODS, job.namespace, pod["metadata"]["name"],
                                               grace_period_seconds=DELETED_JOB_GRACE_S)

    async def sweep(self) -> list[str]:
        return []  # a trainer lives on its job's RayCluster, which the garbage collector deletes with the job
