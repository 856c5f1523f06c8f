"""Two replicas with kopf's peering on the real local cluster: the one a peer of higher priority
outranks stands by (its job loops too, not only kopf's watches), so a hand-over restarts nothing;
it serves again when that peer leaves."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from operator_itest import apply, free_port, kget, sample, scrape, tiny_manifest, wait_for, wait_phase
from operator_process import OperatorProcess

pytestmark = [pytest.mark.cluster]

PEERING_CRDS = Path(__file__).resolve().parents[3] / "charts" / "ppojob-operator" / "files" / "crds" / "kopf-peering.yaml"
HEARTBEAT_S = 20  # the fixtures' --heartbeat-timeout: a replica on frozen reports would take the trainer for lost after it


def writes(operator: OperatorProcess) -> int:
    """The operator's API requests other than reads (its peering reads go on while it stands by)."""
    return sum(n for request, n in operator.requests().items() if not request.startswith("GET"))


def test_an_outranked_replica_stands_by_and_the_job_is_not_restarted(local_cluster, ppojob_crd, k8s_namespace, tmp_path):
    ns = k8s_namespace
    local_cluster.kubectl("apply", "--server-side", "-f", str(PEERING_CRDS))
    local_cluster.wait_established("kopfpeerings.kopf.dev")
    local_cluster.kubectl("apply", "-n", ns, "-f", "-",
                          input="apiVersion: kopf.dev/v1\nkind: KopfPeering\nmetadata: {name: ppojob}\n")
    shared_state = tmp_path / "state"  # the local launcher's trainers: B adopts what A started

    ports = {"low": free_port(), "high": free_port()}

    def replica(name: str, priority: int) -> OperatorProcess:
        return OperatorProcess(local_cluster, ns, tmp_path / name,
                               ["--peering", "ppojob", "--priority", str(priority), "--state-dir", str(shared_state),
                                "--metrics-port", str(ports[name])],
                               {"STANDIN_STEP_SECONDS": "0.4"})

    def serving_and_training(name: str) -> tuple[float, float]:
        samples = scrape(ports[name])
        return sample(samples, "ppojob_operator_serving"), sample(samples, "ppojob_operator_ppojobs", phase="Training")

    low, high = replica("low", 10), replica("high", 20)
    for process in (low, high):
        process.workdir.mkdir()
    try:
        low.start()
        apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 200}))
        wait_for("a second step under the first replica",
                 lambda: ((kget(local_cluster, "ppojob", ns, "tiny") or {}).get("status") or {})
                 .get("progress", {}).get("step", 0) >= 2, timeout=120)
        high.start()
        wait_for("the first replica standing by", lambda: "stands by" in low.log(), timeout=30)
        before = kget(local_cluster, "ppojob", ns, "tiny")["status"]
        low_writes = writes(low)
        time.sleep(HEARTBEAT_S + 10)  # past the deadline at which frozen reports would read as a lost trainer
        during = kget(local_cluster, "ppojob", ns, "tiny")["status"]
        assert writes(low) == low_writes, "the outranked replica wrote to the API while standing by"
        assert during.get("attempt") == before.get("attempt") and during.get("restarts", 0) == 0, during
        assert during["progress"]["step"] > before["progress"]["step"], "the serving replica folded no report"
        # Metrics: only the leader counts the job, so a sum over the replicas counts it once.
        assert serving_and_training("low") == (0, 0) and serving_and_training("high") == (1, 1)
        high.stop()  # a clean exit takes its entry out of the peering object
        wait_for("the first replica serving again", lambda: "now serves" in low.log().rsplit("stands by", 1)[-1],
                 timeout=30)
        job = wait_phase(local_cluster, ns, "tiny", "Succeeded", "Failed", timeout=180)
        assert job["status"]["phase"] == "Succeeded" and job["status"].get("restarts", 0) == 0, job["status"]
    finally:
        for process in (high, low):
            process.stop()
            process.stop_trainers()
