"""Events tell the story: one per phase change and per condition turning true; warm-up and checkpoints."""

from __future__ import annotations

import asyncio
import logging

from kopf._cogs.clients import api
from kopf._cogs.clients import events as kopf_events
from kopf._cogs.structs.references import Resource

from ppo_operator.events import (
    REPORTING_COMPONENT,
    Event,
    compute_events,
    compute_progress_events,
    compute_refused_status_event,
)
from ppo_operator.main import build_settings


def test_phase_change_and_gang_scheduled_become_events_in_story_order():
    old = {"phase": "Scheduling", "conditions": [{"type": "GangScheduled", "status": "False", "reason": "GangPending"}]}
    new = {
        "phase": "Initializing", "reason": "ClusterNotReady", "message": "waiting for RayCluster tiny-a0",
        "conditions": [{"type": "GangScheduled", "status": "True", "reason": "GangScheduled", "message": "3 pods placed together (Coscheduling)"}],
    }
    assert compute_events(old, new) == [
        Event("Normal", "GangScheduled", "3 pods placed together (Coscheduling)"),
        Event("Normal", "ClusterNotReady", "Initializing: waiting for RayCluster tiny-a0"),
    ]


def test_failures_are_warnings():
    (event,) = compute_events({"phase": "Training"}, {"phase": "Restarting", "reason": "PodLost", "message": "restart 1/3"})
    assert event == Event("Warning", "PodLost", "Restarting: restart 1/3")


def test_no_transition_no_event():
    status = {"phase": "Training", "conditions": [{"type": "ClusterReady", "status": "True", "reason": "ClusterReady"}]}
    assert compute_events(status, status) == []


def test_progress_events_for_warmup_steps_and_checkpoints():
    old = {"criticOnlyStepsDone": 1, "criticOnlySteps": 2}
    new = {"criticOnlyStepsDone": 2, "criticOnlySteps": 2, "lastCheckpoint": {"step": 2, "path": "/c/2"}}
    assert compute_progress_events(old, new) == [
        Event("Normal", "CriticWarmupDone", "critic-only warm-up 2/2 done"),
        Event("Normal", "CheckpointWritten", "checkpoint of step 2 at /c/2"),
    ]
    assert compute_progress_events(new, new) == []
    # A resumed trainer reports the checkpoint it resumed from (its time read back from the file): not new.
    resumed = {**new, "lastCheckpoint": {"step": 2, "path": "/c/2", "time": "2026-01-01T12:00:01Z"}}
    assert compute_progress_events({**new, "lastCheckpoint": {**new["lastCheckpoint"], "time": "t"}}, resumed) == []


def test_a_new_held_out_evaluation_is_an_event_with_its_step_and_values():
    old = {"step": 4, "evaluation": {"step": 2, "rewardMean": 0.25, "samples": 64}}
    new = {"step": 5, "evaluation": {"step": 5, "rewardMean": 0.421349, "passRate": 0.3, "samples": 64}}
    assert compute_progress_events(old, new) == [Event(
        "Normal", "Evaluated", "held-out evaluation after step 5: mean reward 0.4213, pass rate 0.3000 (64 prompts)")]
    assert compute_progress_events(new, {**new, "step": 6}) == []  # the same evaluation, reported again
    assert compute_progress_events({}, old)[0].message == (
        "held-out evaluation after step 2: mean reward 0.2500 (64 prompts)")  # no pass rate: a graded reward


def test_a_refused_status_of_an_invalid_spec_becomes_an_invalid_spec_warning_with_the_servers_words():
    status = {"phase": "Failed", "reason": "InvalidSpec", "message": "spec.ppo.numRollouts: not an integer"}
    reply = '{"kind":"Status","message":"PPOJob \\"bad\\" is invalid: expected int, got string","code":422}'
    assert compute_refused_status_event(status, reply) == Event(
        "Warning", "InvalidSpec",
        "spec.ppo.numRollouts: not an integer; the API server refuses to store this job's status"
        " (PPOJob \"bad\" is invalid: expected int, got string); fix or recreate the object",
    )


def test_a_refused_status_of_a_spec_the_operator_accepts_is_still_an_invalid_spec_warning():
    event = compute_refused_status_event({"phase": "Pending", "reason": "Created", "message": "creating"}, "not json")
    assert (event.type, event.reason) == ("Warning", "InvalidSpec")
    assert event.message == "the API server refuses to store this job's status (not json); fix or recreate the object"


def test_events_are_reported_by_the_operator_not_kopf(monkeypatch):
    """The body kopf's own event poster sends with the operator's settings (its transport captured)."""
    sent: list[dict] = []

    async def post(*, url, payload, **_):
        sent.append({"url": url, **payload})

    monkeypatch.setattr(api, "post", post)
    ref = {"apiVersion": "ppojob.io/v1alpha1", "kind": "PPOJob", "name": "tiny", "namespace": "team-a", "uid": "u1"}
    asyncio.run(kopf_events.post_event(
        ref=ref, type="Normal", reason="Created", message="created RayCluster tiny-a0",
        resource=Resource("", "v1", "events", namespaced=True), settings=build_settings("ppojob-operator-7d9f-abcde"),
        logger=logging.getLogger("test")))
    (body,) = sent
    assert REPORTING_COMPONENT == "ppojob-operator"
    assert body["source"] == {"component": "ppojob-operator"}  # kubectl describe's From column
    assert body["reportingComponent"] == "ppojob-operator"
    assert body["reportingInstance"] == "ppojob-operator-7d9f-abcde"
    assert body["metadata"]["generateName"].startswith("ppojob-operator-")
    assert "/namespaces/team-a/events" in body["url"]
