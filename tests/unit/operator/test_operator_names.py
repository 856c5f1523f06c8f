"""Child names are deterministic and fit Kubernetes' length limits."""

from __future__ import annotations

from ppo_operator import names


def test_names_are_a_function_of_job_and_attempt():
    assert names.raycluster_name("tiny", 0) == names.raycluster_name("tiny", 0) == "tiny-a0"
    assert names.pod_group_name("tiny", 2) == "tiny-a2"
    assert names.service_account_name("tiny") == "tiny-trainer"


def test_long_job_names_are_shortened_stably_within_limits():
    long = "a-very-long-ppojob-name-" * 10
    cluster = names.raycluster_name(long, 12)
    assert cluster == names.raycluster_name(long, 12)
    assert len(cluster + "-head-svc") <= 63
    assert len(names.job_label_value(long)) <= 63
    assert names.raycluster_name(long + "x", 12) != cluster
