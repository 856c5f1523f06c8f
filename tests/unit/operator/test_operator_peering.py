"""Replicas of the chart's Deployment must get distinct kopf peering priorities (equal ones freeze all)."""

from ppo_operator.main import peering_priority


def test_replicas_get_distinct_stable_priorities():
    a = peering_priority(None, "ppojob-operator-7d9f8-abcde")
    b = peering_priority(None, "ppojob-operator-7d9f8-fghij")
    assert a != b and a > 0 and b > 0
    assert a == peering_priority(None, "ppojob-operator-7d9f8-abcde")


def test_an_explicit_priority_wins_and_no_pod_name_means_zero():
    assert peering_priority(100, "any") == 100
    assert peering_priority(None, None) == 0
