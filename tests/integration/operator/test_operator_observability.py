"""What a user and a Prometheus see of a job on the local cluster, with the real trainer (`ppo-train`
as the local launcher's trainer, on this machine's CPU): the ETA column of `kubectl get`, /metrics
moving as the job goes (reconcile histogram, PPOJobs by phase, reports folded), the Events from the
operator (not kopf), and the TensorBoard event files in the run directory."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from operator_itest import apply, free_port, kget, sample, scrape, tiny_manifest, wait_for, wait_phase
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PPO_TRAIN = Path(sys.executable).with_name("ppo-train")
STEPS, WARMUP = 8, 2
DURATION = re.compile(r"^(\d+s|\d+m\d\ds|\d+h\d\dm|\d+d\d\dh)$")


def get_columns(cluster, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get ppojob NAME` as its header names the columns (cells may hold spaces: cut by offsets)."""
    header, row = cluster.kubectl("get", "ppojob", name, "-n", namespace).stdout.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    return {names[i]: row[start:(starts[i + 1] if i + 1 < len(starts) else None)].strip()
            for i, start in enumerate(starts)}


class Sampler:
    """Reads `kubectl get` and /metrics every half second while the job runs; keeps what was seen."""

    def __init__(self, cluster, namespace: str, name: str, port: int):
        self.cluster, self.namespace, self.name, self.port = cluster, namespace, name, port
        self.rows: list[dict[str, str]] = []
        self.scrapes: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.rows.append(get_columns(self.cluster, self.namespace, self.name))
                self.scrapes.append(scrape(self.port))
            except (OSError, ValueError, subprocess.CalledProcessError):  # the job is not there yet
                pass

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(10)


def test_eta_in_kubectl_get_metrics_events_and_tensorboard_of_a_real_run(local_cluster, k8s_namespace,
                                                                       start_operator):
    ns, port = k8s_namespace, free_port()
    # The real trainer's first report follows its imports and Ray's start (tens of seconds on a
    # loaded 2-core machine): a heartbeat timeout of the stand-in's 20 s would take it for lost.
    operator = start_operator("--trainer-command", str(PPO_TRAIN), "--metrics-port", str(port),
                              "--heartbeat-timeout", "300")
    before = scrape(port)
    assert sample(before, "ppojob_operator_ppojobs", phase="Training") == 0
    sampler = Sampler(local_cluster, ns, "tiny", port)
    try:
        apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": STEPS, "numCriticOnlySteps": WARMUP}))
        job = wait_phase(local_cluster, ns, "tiny", "Succeeded", "Failed", timeout=480)
    finally:
        sampler.finish()
    assert job["status"]["phase"] == "Succeeded", job["status"]
    progress = job["status"]["progress"]
    assert (progress["percent"], progress["estimatedRemainingSeconds"], progress["eta"]) == (100, 0, "0s")

    # kubectl get: the ETA column while training, a readable duration; 0s at the end
    assert get_columns(local_cluster, ns, "tiny")["ETA"] == "0s"
    training = [row for row in sampler.rows if row.get("PHASE") == "Training" and row.get("ETA")]
    assert training, f"no Training row with an ETA among {sampler.rows[-5:]}"
    assert all(DURATION.match(row["ETA"]) for row in training), training
    assert any(row["ETA"] != "0s" for row in training), training

    # /metrics: the phase gauge went through Training to Succeeded, the histogram and the folds moved
    assert any(sample(s, "ppojob_operator_ppojobs", phase="Training") == 1 for s in sampler.scrapes)
    def succeeded_in_gauge() -> dict | None:
        samples = scrape(port)
        return samples if sample(samples, "ppojob_operator_ppojobs", phase="Succeeded") == 1 else None

    after = wait_for("the Succeeded job in the phase gauge", succeeded_in_gauge)
    assert sample(after, "ppojob_operator_ppojobs", phase="Training") == 0
    count = "ppojob_operator_reconcile_duration_seconds_count"
    assert sample(after, count) > sample(before, count) + 5
    assert sample(after, "ppojob_operator_reconcile_duration_seconds_bucket", le="+Inf") == sample(after, count)
    assert sample(after, "ppojob_operator_reconcile_duration_seconds_sum") > 0
    assert sample(after, "ppojob_operator_trainer_reports_total", outcome="folded") >= 3
    assert sample(after, "ppojob_operator_trainer_reports_total", outcome="refused") == 0
    assert sample(after, "ppojob_operator_api_requests_total", verb="POST", resource="rayclusters") == 1
    assert sample(after, "ppojob_operator_api_requests_total", verb="PATCH", resource="ppojobs/status") >= 3

    # Events: from the operator, named after it
    events = [e for e in kget(local_cluster, "events", ns) if e["involvedObject"].get("kind") == "PPOJob"]
    assert len(events) >= 3
    assert {e["source"].get("component") for e in events} == {"ppojob-operator"}
    assert {e.get("reportingComponent") for e in events} == {"ppojob-operator"}
    assert all(e["metadata"]["name"].startswith("ppojob-operator-") for e in events)
    told = local_cluster.kubectl("describe", "ppojob", "tiny", "-n", ns).stdout.split("\nEvents:", 1)[1]
    assert "ppojob-operator" in told and "kopf" not in told  # the From column

    # TensorBoard: the run directory holds one scalar per step for each metric
    run_dir = operator.state_dir / ns / f"tiny-{job['metadata']['uid']}" / "run"
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("reward/mean")] == list(range(STEPS))
    assert [e.step for e in accumulator.Scalars("loss/policy")] == list(range(WARMUP, STEPS))
    print(f"[observability] kubectl get rows with an ETA while training: {[r['ETA'] for r in training]}; "
          f"reconciles {sample(after, count) - sample(before, count):.0f}, "
          f"reports folded {sample(after, 'ppojob_operator_trainer_reports_total', outcome='folded'):.0f}")
