"""How the trainer of an attempt is started, observed and stopped: one small interface, two launchers.

`RayJobsLauncher` (real clusters) submits to the head's job-submission API; `LocalLauncher`
(development mode) runs `ppo-train` as a process on the operator's machine, for the local cluster
whose pods run no containers. Both are idempotent per (job uid, attempt).
"""

from __future__ import annotations

from typing import Protocol

from ppo_operator.job import Job
from ppo_operator.observed import TrainerRecord


class Launcher(Protocol):
    poll_seconds: float
    """How often a running trainer's state is looked at (no API-server requests involved)."""

    async def observe(self, job: Job, attempt: int) -> TrainerRecord: ...

    async def launch(self, job: Job, attempt: int) -> TrainerRecord: ...

    async def stop_others(self, job: Job, keep_attempt: int | None) -> list[int]:
        """Stop the trainers of every attempt but `keep_attempt` (None: all); the attempts stopped."""
        ...

    async def forget(self, job: Job) -> None:
        """The job is deleted: stop everything and drop local state."""
        ...

    async def sweep(self) -> list[str]:
        """At the operator's start: `forget` the jobs deleted while no operator ran; what was dropped."""
        ...
