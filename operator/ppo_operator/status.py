"""compute_status: the job's status as a pure function of the job, what was observed, and the clock.

The operator writes every key of `status`; `progress` is the trainer's latest report (from its
progress ConfigMap), folded into the same write as the phase it moves. The phase follows the
attempt through Pending (children being created), Scheduling (gang not yet placed), Initializing
(cluster starting, trainer starting), CriticWarmup / Training (from the trainer's progress), to
Succeeded or Failed; Suspended and Restarting around them. A failure of the attempt restarts the
job (attempt + 1) while restarts < backoffLimit. Depends on `decisions`, `conditions`, `observed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from ppo_operator import names
from ppo_operator.conditions import UNKNOWN, get_condition, is_true, set_condition
from ppo_operator.decisions import (
    Policy,
    Verdict,
    describe_pending_gang,
    find_failure,
    gang_placement,
    is_deadline_exceeded,
    is_finished_by_trainer,
)
from ppo_operator.gang.kueue import never_fits
from ppo_operator.job import Job, format_time, parse_time
from ppo_operator.observed import ClusterRecord, Observed, PodRecord, TrainerState, WorkloadRecord
from ppojob_api.progress import urgency
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import ConditionType, Phase, Reason

OPERATOR_KEYS = (
    "phase", "reason", "message", "observedGeneration", "startTime", "completionTime",
    "restarts", "evictions", "attempt", "children", "conditions", "progress",
)
# Conditions that describe the running attempt; reset on restart, suspend and finish.
ATTEMPT_CONDITIONS = (ConditionType.ADMITTED, ConditionType.GANG_SCHEDULED, ConditionType.CLUSTER_READY, ConditionType.PODS_READY,
                      ConditionType.TRAINER_RUNNING)


def operator_status(status: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a status the operator writes (all of it, unknown keys aside)."""
    return {k: status[k] for k in OPERATOR_KEYS if k in status and status[k] is not None}


class _Draft:
    """The status being computed: a dict plus the condition setter with the clock and generation bound."""

    def __init__(self, job: Job, now: datetime):
        self.job, self.now = job, now
        self.status = operator_status(job.status)
        self.status["observedGeneration"] = job.generation
        self.status.setdefault("restarts", 0)
        self.status.setdefault("attempt", 0)
        self.status.setdefault("conditions", [])
        if job.report is not None:
            self.status["progress"] = dict(job.report)

    @property
    def conditions(self) -> list[dict[str, Any]]:
        return self.status["conditions"]

    def condition(self, type_: ConditionType, status: bool | str, reason: Reason, message: str, since=None) -> None:
        self.status["conditions"] = set_condition(
            self.conditions, type_, status, reason, message, now=self.now, generation=self.job.generation, since=since
        )

    def phase(self, phase: Phase, reason: Reason, message: str) -> dict[str, Any]:
        self.status.update(phase=phase.value, reason=reason.value, message=message)
        return self.status

    def reset_attempt(self, reason: Reason, message: str, status: bool | str = UNKNOWN,
                      types: tuple[ConditionType, ...] = ATTEMPT_CONDITIONS) -> None:
        """The attempt's conditions become Unknown (a new attempt starts) or False (the job ended)."""
        for type_ in types:
            if get_condition(self.conditions, type_) is not None:
                self.condition(type_, status, reason, message)

    def finish(self, phase: Phase, reason: Reason, message: str) -> dict[str, Any]:
        """Succeeded or Failed: the cluster goes (so do its conditions), the trainer is stopped."""
        torn_down = f"{phase.value}: the RayCluster and its pod group are deleted"
        for type_ in (ConditionType.GANG_SCHEDULED, ConditionType.CLUSTER_READY, ConditionType.PODS_READY):
            if get_condition(self.conditions, type_) is not None:
                self.condition(type_, False, Reason.CLUSTER_DELETED, torn_down)
        if get_condition(self.conditions, ConditionType.TRAINER_RUNNING) is not None:
            self.condition(ConditionType.TRAINER_RUNNING, False, reason, message)
        warmup = get_condition(self.conditions, ConditionType.CRITIC_WARMUP)
        if warmup is not None and warmup.get("status") == "True":
            self.condition(ConditionType.CRITIC_WARMUP, False, reason, message)
        self.condition(ConditionType.SUCCEEDED, phase == Phase.SUCCEEDED, reason, message)
        if phase == Phase.FAILED:
            self.condition(ConditionType.FAILED, True, reason, message)
        self.status["completionTime"] = format_time(self.now)
        # The trainer's identity is revoked with the end of the job (`Plan.revoke_identity`).
        self.status["children"] = {k: v for k, v in (self.status.get("children") or {}).items() if k != "serviceAccount"}
        return self.phase(phase, reason, message)


def compute_status(job: Job, observed: Observed, now: datetime, *, policy: Policy | None = None) -> dict[str, Any]:
    """The new status (compare with `operator_status(job.status)`)."""
    policy = policy or Policy()
    draft = _Draft(job, now)
    old_phase = job.status.get("phase")
    if old_phase in (Phase.SUCCEEDED.value, Phase.FAILED.value):
        return draft.status
    spec, problem = job.parse()
    if spec is not None:
        problem = policy.check(spec) or observed.reference_problem
    if spec is None or problem:
        draft.condition(ConditionType.VALID, False, Reason.INVALID_SPEC, problem or "")
        return draft.finish(Phase.FAILED, Reason.INVALID_SPEC, problem or "")
    draft.condition(ConditionType.VALID, True, Reason.CREATED, "the spec passed the operator's checks")
    draft.status.setdefault("startTime", format_time(now))
    if spec.run_policy.suspend:
        return _suspended(draft)
    if old_phase == Phase.SUSPENDED.value:
        _resume(draft)
    if is_deadline_exceeded(spec, parse_time(draft.status["startTime"]), now):
        limit = spec.run_policy.active_deadline_seconds
        return draft.finish(
            Phase.FAILED, Reason.DEADLINE_EXCEEDED, f"runPolicy.activeDeadlineSeconds ({limit}s) exceeded"
        )
    attempt_job = _with_attempt(job, draft.status["attempt"])
    return _attempt_status(draft, attempt_job, spec, observed, policy, old_phase)


def _with_attempt(job: Job, attempt: int) -> Job:
    return replace(job, status={**job.status, "attempt": attempt})


def _suspended(draft: _Draft) -> dict[str, Any]:
    message = "runPolicy.suspend is true: the RayCluster is deleted, progress is kept; set it to false to resume"
    draft.condition(ConditionType.SUSPENDED, True, Reason.SUSPENDED, message)
    draft.reset_attempt(Reason.SUSPENDED, "suspended")
    return draft.phase(Phase.SUSPENDED, Reason.SUSPENDED, message)


def _resume(draft: _Draft) -> None:
    draft.status["attempt"] += 1
    draft.status["startTime"] = format_time(draft.now)  # as a Job: the deadline counts from the resume
    draft.condition(
        ConditionType.SUSPENDED, False, Reason.RESUMED, f"resumed as attempt {draft.status['attempt']} from the last checkpoint"
    )


def _children(job: Job, spec: PPOJobSpec, observed: Observed, policy: Policy) -> dict[str, str]:
    attempt = job.attempt
    # Named before they exist (the plan that follows creates them), so that one write says it all.
    children = {"rayCluster": names.raycluster_name(job.name, attempt),
                "serviceAccount": names.service_account_name(job.name)}
    if policy.backend(spec).pod_group_resource is not None:
        children["podGroup"] = names.pod_group_name(job.name, attempt)
    if observed.trainer.handle:
        children["submission"] = observed.trainer.handle
    return children


def _restart_or_fail(draft: _Draft, spec: PPOJobSpec, failure: Verdict) -> dict[str, Any]:
    restarts, limit = draft.status["restarts"], spec.run_policy.backoff_limit
    if not failure.retryable:
        return draft.finish(Phase.FAILED, failure.reason, failure.message)
    if restarts >= limit:
        message = f"{failure.reason.value}: {failure.message}; runPolicy.backoffLimit ({limit}) reached"
        return draft.finish(Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED, message)
    draft.status["restarts"] = restarts + 1
    draft.status["attempt"] += 1
    checkpoint = (draft.job.progress.get("lastCheckpoint") or {}).get("step")
    where = f"step {checkpoint}" if checkpoint is not None else "the start (no checkpoint yet)"
    message = f"restart {restarts + 1}/{limit} from {where}: {failure.message}"
    draft.reset_attempt(failure.reason, message)
    return draft.phase(Phase.RESTARTING, failure.reason, message)


def _attempt_status(
    draft: _Draft, job: Job, spec: PPOJobSpec, observed: Observed, policy: Policy, old_phase: str | None
) -> dict[str, Any]:
    attempt, backend = job.attempt, policy.backend(spec)
    draft.status["children"] = _children(job, spec, observed, policy)
    cluster = observed.cluster_of(attempt)
    if cluster is not None and backend.cluster_suspended():
        workload = observed.workload_of(cluster.name)
        if cluster.suspended:
            return _queued(draft, spec, cluster, workload)
        _admitted(draft, spec, cluster, workload)
    gang_condition = get_condition(draft.conditions, ConditionType.GANG_SCHEDULED)
    if gang_condition is None or gang_condition.get("status") == UNKNOWN:
        # The attempt's clock for scheduling.scheduleTimeoutSeconds starts here.
        draft.condition(ConditionType.GANG_SCHEDULED, False, Reason.GANG_PENDING, "creating the gang")
    failure = find_failure(job, spec, observed, draft.conditions, draft.now, policy)
    if failure is not None:
        return _restart_or_fail(draft, spec, failure)
    if is_finished_by_trainer(job, observed):
        progress = job.progress
        return draft.finish(
            Phase.SUCCEEDED, Reason.SUCCEEDED,
            f"{progress.get('steps') or spec.ppo.num_rollouts} steps done" + (
                f"; last checkpoint {progress['lastCheckpoint'].get('path')}" if progress.get("lastCheckpoint") else ""
            ) + (f"; exported to {progress['lastExport'].get('path')}" if progress.get("lastExport") else ""),
        )
    if old_phase == Phase.RESTARTING.value and (observed.stale(attempt) or cluster is None):
        return draft.status  # the previous attempt is still being torn down
    if cluster is None:
        return draft.phase(Phase.PENDING, Reason.CREATED, f"creating the gang and the RayCluster of attempt {attempt}")
    placement = gang_placement(job, spec, observed, attempt)
    if not placement.placed:
        words = describe_pending_gang(job, spec, observed, attempt, backend)
        draft.condition(ConditionType.GANG_SCHEDULED, False, Reason.GANG_PENDING, words)
        return draft.phase(Phase.SCHEDULING, Reason.GANG_PENDING, words)
    draft.condition(
        ConditionType.GANG_SCHEDULED, True, Reason.GANG_SCHEDULED,
        f"{placement.expected} pods placed together ({backend.label})", since=placement.since,
    )
    if not cluster.ready:
        message = f"waiting for RayCluster {cluster.name} to be ready (state: {cluster.state})"
        draft.condition(ConditionType.CLUSTER_READY, False, Reason.CLUSTER_NOT_READY, message)
        return draft.phase(Phase.INITIALIZING, Reason.CLUSTER_NOT_READY, message)
    draft.condition(ConditionType.CLUSTER_READY, True, Reason.CLUSTER_READY, f"RayCluster {cluster.name} is ready")
    _pods_ready_condition(draft, observed.gang_pods(attempt))
    trainer = observed.trainer
    if trainer.state == TrainerState.NOT_STARTED:
        message = f"starting the trainer of attempt {attempt}"
        draft.condition(ConditionType.TRAINER_RUNNING, False, Reason.TRAINER_PENDING, message)
        return draft.phase(Phase.INITIALIZING, Reason.TRAINER_PENDING, message)
    draft.condition(
        ConditionType.TRAINER_RUNNING, True, Reason.TRAINER_STARTED, f"trainer {trainer.handle} (attempt {attempt})"
    )
    return _training_phase(draft, spec, job)


def _queued(draft: _Draft, spec: PPOJobSpec, cluster: ClusterRecord, workload: WorkloadRecord | None) -> dict[str, Any]:
    """Kueue holds the RayCluster suspended: not admitted yet, or admitted and then evicted (preempted),
    when KubeRay deletes its pods. Neither is a failure nor a restart: the job waits in its queue, in
    Kueue's words, and its attempt goes on in the same RayCluster once Kueue admits it again."""
    queue = spec.scheduling.queue
    evicted_now = is_true(draft.conditions, ConditionType.ADMITTED)
    if workload is None:
        reason, detail, since = Reason.QUEUED, (
            f"waiting for Kueue to make the Workload of RayCluster {cluster.name}"
            " (is Kueue running, with the ray.io/raycluster integration?)"), None
    elif workload.evicted is not None:
        reason, detail, since = workload.evicted.reason, f"evicted by Kueue: {workload.evicted.message}", workload.evicted.since
    elif workload.pending is not None:
        reason, detail, since = workload.pending.reason, workload.pending.message, workload.created
    else:
        reason, detail, since = Reason.QUEUED, "waiting for Kueue to consider the Workload", workload.created
    message = f"LocalQueue {queue}: {detail}"
    if workload is not None and workload.evicted is None and never_fits(detail):
        return draft.finish(Phase.FAILED, Reason.QUEUE_CAPACITY_EXCEEDED, (
            f"spec.resources: the job asks for more than the ClusterQueue of LocalQueue {queue} can ever admit"
            f" ({detail}); ask for fewer GPUs or raise the ClusterQueue's quota"))
    if evicted_now:
        draft.status["evictions"] = draft.status.get("evictions", 0) + 1
    evicted = workload is not None and workload.evicted is not None
    # Unknown until admitted: the gang's clock (scheduling.scheduleTimeoutSeconds) starts at admission.
    draft.reset_attempt(Reason.EVICTED if evicted else Reason.QUEUED, message, types=ATTEMPT_CONDITIONS[1:])
    draft.condition(ConditionType.ADMITTED, False, reason, message, since=since)
    if evicted:
        checkpoint = (draft.job.progress.get("lastCheckpoint") or {}).get("step")
        where = f"step {checkpoint}" if checkpoint is not None else "the start (no checkpoint yet)"
        return draft.phase(Phase.QUEUED, Reason.EVICTED, (
            f"{message}; not a restart: once Kueue admits RayCluster {cluster.name} again the trainer resumes from {where}"))
    return draft.phase(Phase.QUEUED, Reason.QUEUED, message)


def _admitted(draft: _Draft, spec: PPOJobSpec, cluster: ClusterRecord, workload: WorkloadRecord | None) -> None:
    """Kueue unsuspended the RayCluster: the Admitted condition says when and where, in Kueue's words."""
    if workload is None or workload.admitted is None:  # the Workload's watch is behind the RayCluster's
        draft.condition(ConditionType.ADMITTED, True, Reason.ADMITTED, f"Kueue unsuspended RayCluster {cluster.name}")
        return
    queued = f", queued since {format_time(workload.created)}" if workload.created else ""
    draft.condition(
        ConditionType.ADMITTED, True, workload.admitted.reason,
        f"admitted by ClusterQueue {workload.cluster_queue} through LocalQueue {spec.scheduling.queue}"
        f" (Workload {workload.name}{queued})",
        since=workload.admitted.since,
    )


def _pods_ready_condition(draft: _Draft, pods: list[PodRecord]) -> None:
    """Pods that stopped being ready while the attempt runs (a node that stopped reporting, a
    container that failed its probe): said, not acted on; the trainer may well carry on."""
    unready = [p for p in pods if not p.deleting and not p.ready]
    if unready:
        words = "; ".join(f"pod {p.name} on node {p.node or '?'} is not ready" for p in unready)
        draft.condition(ConditionType.PODS_READY, False, Reason.PODS_NOT_READY, words)
    else:
        draft.condition(ConditionType.PODS_READY, True, Reason.PODS_READY, f"all {len(pods)} pods are ready")


def _training_phase(draft: _Draft, spec: PPOJobSpec, job: Job) -> dict[str, Any]:
    reported = job.progress.get("attempt")
    if reported is not None and reported != job.attempt:  # what is there is an earlier attempt's progress
        message = f"the trainer of attempt {job.attempt} started; waiting for its first report"
        return draft.phase(Phase.INITIALIZING, Reason.TRAINER_STARTED, message)
    total = spec.ppo.num_critic_only_steps
    done = int(job.progress.get("criticOnlyStepsDone") or 0)
    if done < total:
        message = f"critic-only warm-up of {total} steps (the actor is frozen)"
        draft.condition(ConditionType.CRITIC_WARMUP, True, Reason.WARMUP_STEP, message)
        return draft.phase(Phase.CRITIC_WARMUP, Reason.WARMUP_STEP, message)
    if total:
        draft.condition(ConditionType.CRITIC_WARMUP, False, Reason.WARMUP_DONE, f"critic-only warm-up of {total} steps done")
    return draft.phase(Phase.TRAINING, Reason.TRAINING, "training actor and critic")


def status_changed(job: Job, new: Mapping[str, Any]) -> bool:
    return operator_status(job.status) != dict(new)


def hold_routine_progress(
    job: Job, new: dict[str, Any], *, folded_at: datetime | None, now: datetime, interval_s: float
) -> tuple[dict[str, Any], float | None]:
    """The status to write, and the seconds until the trainer's report it holds back may be folded
    (None: nothing held). A report is folded at once when it is urgent (`ppojob_api.progress`: what
    the operator acts on or tells), when the status is written anyway, or when `interval_s` has passed
    since the last fold; a routine one (a step, a stage, a heartbeat) waits, as the trainer's own
    throttle waits, so that 500 trainers' steps are not 500 PPOJob writes each."""
    stored, reported = job.status.get("progress") or {}, new.get("progress")
    if reported is None or reported == stored or urgency(stored, reported) is not None:
        return new, None
    held = {**new, "progress": stored} if stored else {k: v for k, v in new.items() if k != "progress"}
    wait = 0.0 if folded_at is None else interval_s - (now - folded_at).total_seconds()
    if wait <= 0 or status_changed(job, held):
        return new, None
    return held, wait


def status_patch(job: Job, new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch of the status subresource: changed keys, removed keys as null."""
    return {"status": merge_patch(operator_status(job.status), new)}


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: nested objects patched key by
    key (a key removed inside one is a null there), everything else replaced whole."""
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(before, Mapping) and isinstance(value, Mapping):
            if before != value:
                patch[key] = merge_patch(before, value)
        elif before != value:
            patch[key] = value
    return patch

