"""End to end: the README's main command, `make demo`, run as a person runs it: the story in real pods
from helm install to helm uninstall and kubectl delete crd (tests/e2e/story.py), read back from what
it wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_make_demo_runs_the_readme_story_in_real_pods(local_cluster, tmp_path):
    result = subprocess.run(
        ["make", "-s", "demo", f"DEMO_ARGS=--work-dir {tmp_path}"],
        cwd=REPO, env={**os.environ, "KUBECONFIG": str(local_cluster.kubeconfig)},
        capture_output=True, text=True, timeout=1500, check=False,
    )
    print(result.stdout[-6000:], result.stderr[-3000:])
    story = json.loads((tmp_path / "story.json").read_text())
    assert result.returncode == 0 and story["error"] is None, (story["error"], result.stderr[-3000:])
    status, steps = story["status"], [text for _, text in story["timeline"]]

    # The operator ran as the chart's Deployment: two replicas in containers, peering.
    assert any(re.match(r"operator: 2 replicas Running on real-0 .*both peers", s) for s in steps), steps
    # The job's pods ran in containers on the real node, in a namespace enforcing `restricted`.
    assert "namespace ppo-demo enforces the restricted Pod Security Standard" in steps
    assert any(re.match(r"\d+ pods Running in containers on real-0 ", s) for s in steps), steps
    # A pod in another namespace reaches none of the head's ports, the metrics ports among them: the job's
    # NetworkPolicy, enforced on the real node, refuses the connections. The API server answers that pod.
    head_ports = {int(port): outcome for port, outcome in story["head_ports"]["head"].items()}
    assert {6379, 8265, 8080, 44217, 44227} <= head_ports.keys(), head_ports
    assert set(head_ports.values()) <= {"refused", "timed out"}, head_ports
    assert story["head_ports"]["api server"] == "open", story["head_ports"]
    # The phases a person sees, in order: warm-up before training, then success.
    seen = story["phases_seen"]
    assert seen.index("CriticWarmup") < seen.index("Training") < seen.index("Succeeded"), seen
    watch = (tmp_path / "get-ppojobs-w.txt").read_text()
    assert re.search(r"CriticWarmup\s+\d+/24\s+1/2", watch), watch
    assert re.search(r"Training\s+\d+/24\s+2/2", watch), watch
    assert re.search(r"Succeeded\s+24/24\s+2/2", watch), watch
    progress = status["progress"]
    assert progress["criticOnlyStepsDone"] == 2 and progress["step"] == 24
    assert progress["weightSyncsSkipped"] == 2, "no weight sync in the two critic-only steps"
    offload_states = {s for s in steps if "offload=" in s}
    assert any("actor=Offloaded" in s for s in offload_states), offload_states
    assert any("critic=Offloaded" in s for s in offload_states), offload_states
    # The trainer was a Ray job on the head (the production launcher), and its step lines are in
    # `kubectl logs` of the head; its checkpoints are on the claim.
    head_logs = (tmp_path / "logs-head.txt").read_text()
    assert len(re.findall(r'"step":\s*\d+', head_logs)) >= 24, head_logs[-3000:]
    checkpoints = (tmp_path / "checkpoints.txt").read_text().split()
    assert checkpoints and all(c.startswith("step-") for c in checkpoints), checkpoints
    describe = (tmp_path / "describe.txt").read_text()
    for reason in ("GangScheduled", "ClusterReady", "TrainerStarted", "CriticWarmupDone", "CheckpointWritten",
                   "Succeeded"):
        assert reason in describe, f"no {reason} event in kubectl describe:\n{describe}"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Succeeded"] == "True"

    # The documented teardown left nothing: the job's children, the release, then the CRD.
    assert story["left"] == {}, story["left"]
    kept = steps.index("helm uninstall kept the PPOJob CRD and left nothing else behind")
    assert steps[kept + 1:] == ["kubectl delete crd ppojobs.ppojob.io",
                                "the PPOJob CRD is gone: nothing of the chart is left"], steps[kept:]
    assert not local_cluster.kubectl("get", "crd", "ppojobs.ppojob.io", "--ignore-not-found", "-o", "name").stdout
    # No container of the job runs on the node any more (the kubelet removes stopped sandboxes later).
    running = local_cluster.crictl("pods", "-q", "--namespace", "ppo-demo", "--state", "ready").stdout.split()
    assert not running, f"pod sandboxes still running: {running}"
    print("figures:", story["figures"])
