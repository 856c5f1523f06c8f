"""The tracker's lastExport: each export reported with an 'export' event, and after a resume the one
the checkpoint recorded (TrainerState.last_export), whole, until the next."""

from __future__ import annotations

import json
from dataclasses import asdict

from ppo_trainer.checkpoint import TrainerState
from ppo_trainer.reporting.progress import ProgressTracker
from ppo_trainer.reporting.reporters import ExportInfo, Recorder


def poll():
    return [], {"actor": "OnDevice", "critic": "OnDevice", "rollout": "Awake"}


def tracker(state: TrainerState, recorder: Recorder) -> ProgressTracker:
    return ProgressTracker(reporter=recorder, poll=poll, total_steps=4, critic_only_steps=0, with_critic=True,
                           state=state, attempt=0)


def test_an_export_is_reported_as_last_export_with_an_event():
    recorder = Recorder()
    written = ExportInfo(step=2, path="/c/export/step-00000002", time="t", critic_path="/c/export/critic/step-00000002")
    tracker(TrainerState(step=2), recorder).exported(written, seconds=0.25)
    assert recorder.progress[-1].to_status()["lastExport"] == {
        "step": 2, "path": "/c/export/step-00000002", "time": "t", "criticPath": "/c/export/critic/step-00000002"}
    ((kind, event),) = recorder.events
    assert kind == "export" and event["path"] == written.path and event["seconds"] == 0.25


def test_a_resumed_run_reports_the_export_its_checkpoint_recorded():
    saved = ExportInfo(step=2, path="/c/export/step-00000002", time="t").to_status()
    state = TrainerState(**json.loads(json.dumps(asdict(TrainerState(step=3, last_export=saved)))))  # as a checkpoint
    recorder = Recorder()
    tracker(state, recorder).finish()
    assert recorder.progress[-1].to_status()["lastExport"] == saved
    assert "lastExport" not in tracker(TrainerState(step=3), Recorder()).progress.to_status()
