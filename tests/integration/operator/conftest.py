"""Fixtures of the operator's integration tests: the PPOJob CRD on the local cluster, and the
operator itself as a real `ppo-operator` process (operator_process.py), stopped at the end with every
trainer it started."""

from __future__ import annotations

from pathlib import Path

import pytest
from operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[3]
CRD = ROOT / "crds" / "ppojobs.ppojob.io.yaml"


@pytest.fixture(scope="session")
def ppojob_crd(local_cluster):
    local_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    local_cluster.wait_established("ppojobs.ppojob.io")
    return CRD


@pytest.fixture
def start_operator(local_cluster, ppojob_crd, k8s_namespace, tmp_path):
    """start_operator(*flags, **env) -> a live OperatorProcess for this test's namespace."""
    started: list[OperatorProcess] = []

    def start(*extra: str, **env: str) -> OperatorProcess:
        process = OperatorProcess(local_cluster, k8s_namespace, tmp_path, list(extra), env)
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.stop()
        process.stop_trainers()

