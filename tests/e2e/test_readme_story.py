"""End to end: the README's story on the local cluster (helm, kubectl, operator, real trainer), through
the documented teardown: kubectl delete, helm uninstall (the PPOJob CRD is kept), kubectl delete crd."""

from __future__ import annotations

import re

import pytest
from story import Story

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]


def test_readme_story_from_helm_install_to_helm_uninstall(local_cluster, tmp_path):
    story = Story(cluster=local_cluster, work_dir=tmp_path, out=print)
    try:
        status = story.run(clean_up=False)
        assert status["phase"] == "Succeeded", story.snapshots.get("describe")
        # The phases a person sees, in order: warm-up before training, then success.
        notes = story.snapshots["helm-install"]
        assert "kubectl get ppojobs -w" in notes and "kubectl describe ppojob" in notes, notes
        assert "kubectl delete ppojobs --all -A" in notes and "kubectl delete crd ppojobs.ppojob.io" in notes, notes
        seen = story.phases_seen
        assert seen.index("CriticWarmup") < seen.index("Training") < seen.index("Succeeded"), seen

        watch = (tmp_path / "get-ppojobs-w.txt").read_text()
        assert re.search(r"CriticWarmup\s+\d+/24\s+1/2", watch), watch
        assert re.search(r"Training\s+\d+/24\s+2/2", watch), watch
        assert re.search(r"Succeeded\s+24/24\s+2/2", watch), watch

        progress = status["progress"]
        assert progress["criticOnlyStepsDone"] == 2 and progress["step"] == 24
        assert progress["weightSyncsSkipped"] == 2, "no weight sync in the two critic-only steps"
        offload_states = {line for _, line in story.timeline if "offload=" in line}
        assert any("actor=Offloaded" in s for s in offload_states), offload_states
        assert any("critic=Offloaded" in s for s in offload_states), offload_states

        describe = story.snapshots["describe"]
        for reason in ("GangScheduled", "ClusterReady", "TrainerStarted", "CriticWarmupDone", "CheckpointWritten",
                       "Succeeded"):
            assert reason in describe, f"no {reason} event in kubectl describe:\n{describe}"
        conditions = {c["type"]: c["status"] for c in status["conditions"]}
        assert conditions["Succeeded"] == "True"
    finally:
        left = story.clean_up()
    assert left == {}, left
    assert story.children_left() == {}
    # helm uninstall kept the PPOJob CRD (crds.keep) and nothing else; the story then deleted it.
    uninstall = story.snapshots["helm-uninstall"]
    assert "kept due to the resource policy" in uninstall and "ppojobs.ppojob.io" in uninstall, uninstall
    steps = [text for _, text in story.timeline]
    kept = steps.index("helm uninstall kept the PPOJob CRD and left nothing else behind")
    assert steps[kept + 1:] == ["kubectl delete crd ppojobs.ppojob.io",
                                "the PPOJob CRD is gone: nothing of the chart is left"], steps[kept:]
    assert not story.kubectl("get", "crd", "ppojobs.ppojob.io", "--ignore-not-found", "-o", "name").strip()
