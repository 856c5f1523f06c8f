"""Reporters: the progress ConfigMap patch body, throttling with a fake transport, errors that never crash."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import yaml

from ppo_trainer.reporting.kubernetes import KubernetesReporter, Throttle, progress_patch
from ppo_trainer.reporting.reporters import CheckpointInfo, EvaluationInfo, ExportInfo, JsonLinesReporter, Progress
from ppojob_api.vocabulary import RolloutResidency, Stage, TrainResidency


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def progress(**changes) -> Progress:
    base = Progress(total_steps=10, critic_only_steps=2, attempt=1, step=3, critic_only_steps_done=2,
                    stage=Stage.CRITIC_TRAIN, actor=TrainResidency.OFFLOADED, critic=TrainResidency.ON_DEVICE,
                    rollout=RolloutResidency.ASLEEP, weight_syncs_skipped=2)
    return replace(base, **changes)


def reported(body: dict) -> dict:
    """The `status.progress` a patch of the progress ConfigMap carries."""
    return json.loads(body["data"]["progress"])


def reporter(clock: Clock, sent: list, **kwargs) -> KubernetesReporter:
    return KubernetesReporter(sent.append, min_interval=10, heartbeat_seconds=None, clock=clock, **kwargs)


def test_reporting_patch_body_matches_crd_progress():
    p = progress(metrics={"rewardMean": 0.5}, last_checkpoint=CheckpointInfo(step=2, path="/c/step-2", time="t"))
    body = progress_patch(p, now="2026-01-01T00:00:00Z")
    assert list(body) == ["data"] and list(body["data"]) == ["progress"]
    assert reported(body) == {
        "attempt": 1, "step": 3, "totalSteps": 10, "criticOnlyStepsDone": 2, "criticOnlySteps": 2,
        "steps": "3/10", "percent": 30, "warmup": "2/2", "stage": "CriticTrain", "actor": "Offloaded", "critic": "OnDevice",
        "rollout": "Asleep", "offload": "actor=Offloaded critic=OnDevice rollout=Asleep",
        "weightSyncsSkipped": 2, "finished": False, "metrics": {"rewardMean": 0.5},
        "lastCheckpoint": {"step": 2, "path": "/c/step-2", "time": "t"},
        "heartbeatTime": "2026-01-01T00:00:00Z",
    }
    assert "error" not in reported(body)  # the whole value is replaced: an older attempt's error is gone
    assert "eta" not in reported(body)  # no estimate yet


def test_reporting_progress_fields_are_the_crds():
    crd = yaml.safe_load((Path(__file__).resolve().parents[4] / "crds" / "ppojobs.ppojob.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["progress"]
    p = progress(metrics={"rewardMean": 0.5}, last_checkpoint=CheckpointInfo(step=2, path="/c", time="t"),
                 error="boom", estimated_remaining_seconds=200.4,
                 last_evaluation=EvaluationInfo(step=2, reward_mean=0.5, pass_rate=0.5, samples=4),
                 last_export=ExportInfo(step=2, path="/c/export/step-2", time="t", critic_path="/c/export/critic/step-2"))
    status = progress_patch(p, now="2026-01-01T00:00:00Z")
    fields = reported(status)
    export_schema = schema["properties"]["lastExport"]["properties"]
    assert set(fields["lastExport"]) == set(export_schema) and fields["lastExport"]["criticPath"].endswith("step-2")
    assert (fields["estimatedRemainingSeconds"], fields["eta"], fields["percent"]) == (200, "3m20s", 30)
    assert set(fields) <= set(schema["properties"]), set(fields) - set(schema["properties"])
    # the API server prunes what the schema does not name: the evaluation's keys are all there
    assert set(fields["evaluation"]) == set(schema["properties"]["evaluation"]["properties"])
    assert "eta" in {c["jsonPath"].rsplit(".", 1)[1] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}


def test_reporting_throttles_but_flushes_what_matters():
    clock, sent = Clock(), []
    k8s = reporter(clock, sent)
    warming = {"step": 1, "critic_only_steps_done": 1}
    k8s.report(progress(**warming, stage=Stage.GENERATE))  # first: sent
    k8s.report(progress(**warming, stage=Stage.CRITIC_TRAIN))  # within the interval: held
    k8s.report(progress(step=2, critic_only_steps_done=2, stage=Stage.GENERATE))  # warm-up 2/2: sent at once
    k8s.report(progress(step=3, stage=Stage.GENERATE))  # a step after the warm-up: held
    assert [reported(b)["warmup"] for b in sent] == ["1/2", "2/2"]
    k8s.report(progress(step=3, stage=Stage.CHECKPOINT, last_checkpoint=CheckpointInfo(3, "/c", "t")))
    assert reported(sent[-1])["stage"] == "Checkpoint"
    clock.now = 11
    k8s.report(progress(step=4, stage=Stage.GENERATE, last_checkpoint=CheckpointInfo(3, "/c", "t")))
    assert reported(sent[-1])["step"] == 4  # the interval passed
    k8s.report(progress(step=10, stage=Stage.DONE, finished=True, last_checkpoint=CheckpointInfo(3, "/c", "t")))
    assert reported(sent[-1])["finished"] is True and len(sent) == 5


def test_reporting_throttle_sends_what_the_operator_acts_on_at_once():
    base = progress(stage=Stage.GENERATE)
    throttle = Throttle(10.0)
    assert throttle.due(base, 0.0) is True  # the first report
    throttle.sent(base, 0.0, 0.05)
    assert throttle.due(replace(base, step=4), 9.9) is False
    assert throttle.due(replace(base, step=4), 10.0) is True
    assert throttle.due(replace(base, critic_only_steps_done=1), 0.1) is True


def test_reporting_throttle_waits_longer_while_the_api_server_is_slow():
    throttle = Throttle(10.0)
    throttle.sent(progress(stage=Stage.GENERATE), 0.0, 0.4)
    assert throttle.due(progress(step=4, stage=Stage.GENERATE), 15.0) is False
    assert throttle.due(progress(step=4, stage=Stage.GENERATE), 20.0) is True
    assert throttle.due(progress(stage=Stage.DONE, finished=True), 1.0) is True  # what matters never waits


def test_reporting_measures_its_patches_for_the_throttle():
    clock, sent = Clock(), []

    def slow_patch(body):
        clock.now += 0.4  # the API server takes 0.4 s to answer
        sent.append(body)

    k8s = KubernetesReporter(slow_patch, min_interval=10, heartbeat_seconds=None, clock=clock)
    k8s.report(progress(stage=Stage.GENERATE))
    clock.now = 12.0
    k8s.report(progress(step=4, stage=Stage.GENERATE))  # 12 s after the last: held, the interval is now 20 s
    assert len(sent) == 1 and k8s.throttle.interval() == 20.0
    clock.now = 20.0
    k8s.report(progress(step=5, stage=Stage.GENERATE))
    assert [reported(b)["step"] for b in sent] == [3, 5]


def test_reporting_close_sends_the_held_snapshot():
    clock, sent = Clock(), []
    k8s = reporter(clock, sent)
    k8s.report(progress(stage=Stage.GENERATE))
    k8s.report(progress(stage=Stage.ACTOR_TRAIN))
    k8s.close()
    assert [reported(b)["stage"] for b in sent] == ["Generate", "ActorTrain"]


def test_reporting_error_is_flushed():
    clock, sent = Clock(), []
    k8s = reporter(clock, sent)
    k8s.report(progress(stage=Stage.GENERATE))
    k8s.report(progress(stage=Stage.GENERATE, error="ValueError: boom"))
    assert reported(sent[-1])["error"] == "ValueError: boom"


def test_reporting_api_errors_never_crash_training(caplog):
    clock = Clock()

    def failing(body):
        raise ConnectionError("API server unreachable")

    k8s = KubernetesReporter(failing, min_interval=0, heartbeat_seconds=None, clock=clock)
    k8s.report(progress())
    k8s.report(progress(step=4, stage=Stage.GENERATE))
    k8s.close()
    assert k8s.failures == 2 and "training goes on" in caplog.text


def test_reporting_heartbeat_resends_when_quiet():
    import time

    sent = []
    k8s = KubernetesReporter(sent.append, min_interval=10, heartbeat_seconds=0.2)
    k8s.report(progress(stage=Stage.GENERATE))
    time.sleep(1.3)
    k8s.close()
    assert len(sent) >= 2 and len({reported(b)["heartbeatTime"] for b in sent}) >= 1


def test_reporting_from_environment_is_off_outside_a_job(monkeypatch):
    monkeypatch.delenv("PPOJOB_PROGRESS_CONFIGMAP", raising=False)
    assert KubernetesReporter.from_environment() is None


def test_reporting_json_lines_one_object_per_call():
    stream = io.StringIO()
    json_lines = JsonLinesReporter(stream)
    json_lines.report(progress())
    json_lines.event("transition", role="actor", frm="OnDevice", to="Offloaded", seconds=0.1)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["kind"] == "progress" and first["warmup"] == "2/2" and first["offload"].startswith("actor=")
    assert second == {**second, "kind": "transition", "role": "actor", "to": "Offloaded"}
