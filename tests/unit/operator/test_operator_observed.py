"""The trainer's progress ConfigMap as the operator reads it: whose report it is, and what it says."""

from __future__ import annotations

import json

from ppo_operator.observed import report_of, summarize_report


def configmap(owner_uid: str, data: dict) -> dict:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "data": data,
        "metadata": {"name": "tiny-progress", "ownerReferences": [
            {"apiVersion": "ppojob.io/v1alpha1", "kind": "PPOJob", "name": "tiny", "uid": owner_uid}]},
    }


def test_a_report_is_read_from_its_json_and_belongs_to_the_job_that_owns_it():
    report = summarize_report(configmap("u1", {"progress": json.dumps({"step": 3, "warmup": "2/2"})}))
    assert (report.owner_uid, report.progress) == ("u1", {"step": 3, "warmup": "2/2"})
    assert report_of([report], "u1") == {"step": 3, "warmup": "2/2"}
    assert report_of([report], "u2") is None  # a later job of the same name does not read it


def test_no_report_yet_and_an_unreadable_one_are_both_no_report():
    assert summarize_report(configmap("u1", {})).progress is None
    assert summarize_report(configmap("u1", {"progress": "{not json"})).progress is None
    assert summarize_report(configmap("u1", {"progress": "[1, 2]"})).progress is None
    assert report_of([summarize_report(configmap("u1", {}))], "u1") is None
