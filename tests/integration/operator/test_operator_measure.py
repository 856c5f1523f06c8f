"""Measured on the local cluster: time from apply to children created and to Running (median of
$PPOJOB_OPERATOR_MEASURE_RUNS jobs, one after the other: 3 in `make test`, 10 for the figures in
docs/performance-operator.md), and the API requests the operator makes per job over a full run (counted by a
proxy in front of the API server), which must stay under budget. Prints a table and writes
$PPOJOB_OPERATOR_MEASURE (default: the test's tmp dir) as JSON."""

from __future__ import annotations

import collections
import json
import os
import statistics
import threading
import time
from pathlib import Path

import pytest
import urllib3
from counting_proxy import CountingProxy
from kubernetes import client, config, watch
from operator_itest import kget, tiny_manifest, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RUNS = int(os.environ.get("PPOJOB_OPERATOR_MEASURE_RUNS", "3"))


class Stopwatch:
    """Watches RayClusters and PPOJobs of a namespace (directly, as admin); first-seen times."""

    def __init__(self, cluster, namespace: str):
        api = config.new_client_from_config(str(cluster.kubeconfig))
        self.objects = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.cluster_seen: dict[str, float] = {}
        self.ready_seen: dict[str, float] = {}
        self.running_seen: dict[str, float] = {}
        self.phase: dict[str, str] = {}
        self.stopped = False
        self.watches = [watch.Watch(), watch.Watch()]
        for w, (group, version, plural) in zip(self.watches, [("ray.io", "v1", "rayclusters"),
                                                              ("ppojob.io", "v1alpha1", "ppojobs")], strict=True):
            threading.Thread(target=self._run, args=(w, group, version, plural), daemon=True).start()

    def _run(self, w, group, version, plural) -> None:
        while not self.stopped:  # a watch may end at any time: list and watch again (first-seen times stay)
            try:
                for event in w.stream(self.objects.list_namespaced_custom_object, group, version, self.namespace,
                                      plural, timeout_seconds=300):
                    self._seen(plural, event["object"], time.monotonic())
            except (client.exceptions.ApiException, urllib3.exceptions.HTTPError, OSError, ValueError):
                time.sleep(0.1)

    def _seen(self, plural: str, body: dict, seen: float) -> None:
        name = body["metadata"]["name"]
        if plural == "rayclusters":
            self.cluster_seen.setdefault(name, seen)
            if (body.get("status") or {}).get("state") == "ready":
                self.ready_seen.setdefault(name, seen)
            return
        phase = (body.get("status") or {}).get("phase")
        self.phase[name] = phase
        if phase in ("CriticWarmup", "Training", "Succeeded"):
            self.running_seen.setdefault(name, seen)

    def stop(self) -> None:
        self.stopped = True
        for w in self.watches:
            w.stop()


def test_apply_to_children_and_running_and_api_requests_per_job(local_cluster, k8s_namespace, start_operator, tmp_path):
    ns = k8s_namespace
    proxy = CountingProxy(local_cluster.server, local_cluster.state_dir / "pki").start()
    kubeconfig = proxy.kubeconfig(tmp_path / "proxy.kubeconfig")
    stopwatch = Stopwatch(local_cluster, ns)
    try:
        start_operator(KUBECONFIG=str(kubeconfig), STANDIN_STEP_SECONDS="0.05")
        time.sleep(3)  # startup: kopf's initial lists and watches
        before = proxy.snapshot()
        created, ready, running = [], [], []
        for run in range(RUNS):
            name = f"m{run}"
            manifest = tiny_manifest(name, ppo={"numRollouts": 4, "numCriticOnlySteps": 1}, checkpoint={"interval": 2})
            manifest["apiVersion"], manifest["kind"] = "ppojob.io/v1alpha1", "PPOJob"
            applied = time.monotonic()
            stopwatch.objects.create_namespaced_custom_object("ppojob.io", "v1alpha1", ns, "ppojobs", manifest)
            wait_for(f"{name} succeeded", lambda n=name: stopwatch.phase.get(n) == "Succeeded", timeout=120, interval=0.05)
            created.append(stopwatch.cluster_seen[f"{name}-a0"] - applied)
            # A fast job's RayCluster may go from ready to deleted between two watch events: no sample then.
            if f"{name}-a0" in stopwatch.ready_seen:
                ready.append((stopwatch.ready_seen[f"{name}-a0"] - applied, stopwatch.running_seen[name] - applied))
            running.append(stopwatch.running_seen[name] - applied)
            local_cluster.kubectl("delete", "ppojob", name, "-n", ns, "--timeout=60s")
            wait_for(f"{name} children gone", lambda n=name: not kget(local_cluster, "serviceaccounts", ns,
                                                                      selector=f"ppojob.io/job-name={n}"), timeout=60)
        time.sleep(2)
        counts = proxy.snapshot() - before
    finally:
        stopwatch.stop()
        proxy.stop()
    operator_requests = collections.Counter({f"{verb} {res}": n for (who, verb, res), n in counts.items() if who == "operator"})
    trainer_requests = collections.Counter({f"{verb} {res}": n for (who, verb, res), n in counts.items() if who == "trainer"})
    if not ready:
        raise AssertionError("no RayCluster of the measured jobs was seen ready by the watch")
    result = {
        "runs": RUNS,
        "apply_to_children_created_s": {"median": statistics.median(created), "all": created},
        "apply_to_raycluster_ready_s": {"median": statistics.median(r for r, _ in ready), "all": [r for r, _ in ready]},
        "apply_to_running_s": {"median": statistics.median(running), "all": running},
        "raycluster_ready_to_running_s": {"median": statistics.median(run - r for r, run in ready)},
        "operator_requests_per_job": {k: v / RUNS for k, v in sorted(operator_requests.items())},
        "operator_requests_per_job_total": sum(operator_requests.values()) / RUNS,
        "trainer_requests_per_job": {k: v / RUNS for k, v in sorted(trainer_requests.items())},
    }
    out = Path(os.environ.get("PPOJOB_OPERATOR_MEASURE", tmp_path / "operator-measure.json"))
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    assert result["operator_requests_per_job_total"] < 60
