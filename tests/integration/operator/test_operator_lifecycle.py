"""A PPOJob on the real local cluster: gang pod group and RayCluster, pods placed together on fake
GPU nodes, the status through its phases as the trainer stand-in reports with its own identity,
and what `kubectl get` and `kubectl describe` show."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from operator_itest import PhaseRecorder, apply, condition, kget, tiny_manifest, wait_for, wait_phase

from local_cluster import GANG_SCHEDULER_NAME

pytestmark = [pytest.mark.cluster]


def test_tiny_example_is_gang_scheduled_and_reports_every_phase(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    operator = start_operator()
    recorder = PhaseRecorder(local_cluster, ns, "tiny")
    manifest = tiny_manifest()
    total, warmup = manifest["spec"]["ppo"]["numRollouts"], manifest["spec"]["ppo"]["numCriticOnlySteps"]
    apply(local_cluster, ns, manifest)
    job = wait_for("the job's uid", lambda: kget(local_cluster, "ppojob", ns, "tiny"))
    owner = {"apiVersion": "ppojob.io/v1alpha1", "kind": "PPOJob", "name": "tiny", "uid": job["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}

    group = wait_for("the pod group", lambda: kget(local_cluster, "podgroups.scheduling.x-k8s.io", ns, "tiny-a0"))
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 600, "minResources": {"nvidia.com/gpu": "8"}}
    assert group["metadata"]["ownerReferences"] == [owner]
    cluster = wait_for("the RayCluster", lambda: kget(local_cluster, "rayclusters", ns, "tiny-a0"))
    assert cluster["metadata"]["ownerReferences"] == [owner]
    assert cluster["metadata"]["labels"]["ppojob.io/job-name"] == "tiny"
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]
    assert worker["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "tiny-a0"
    assert worker["spec"]["schedulerName"] == GANG_SCHEDULER_NAME
    assert worker["spec"]["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}

    pods = wait_for(
        "2 pods bound to fake GPU nodes",
        lambda: (p := kget(local_cluster, "pods", ns, selector="ppojob.io/job-name=tiny")) and len(p) == 2
        and all(x["spec"].get("nodeName") for x in p) and p,
    )
    assert {p["spec"]["schedulerName"] for p in pods} == {GANG_SCHEDULER_NAME}
    assert {p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] for p in pods} == {"tiny-a0"}
    gpus = [p["spec"]["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu") for p in pods]
    assert sorted(gpus, key=str) == ["8", None] or sorted(map(str, gpus)) == ["8", "None"]

    job = wait_phase(local_cluster, ns, "tiny", "Succeeded", "Failed", timeout=120)
    recorder.stop()
    assert job["status"]["phase"] == "Succeeded", job["status"]
    seen = recorder.phases
    assert seen[0] in ("Pending", "Scheduling") and seen[-1] == "Succeeded"
    for phase in ("Initializing", "CriticWarmup", "Training"):  # Scheduling may pass between two watch events
        assert phase in seen, seen
    assert seen.index("CriticWarmup") < seen.index("Training")
    progress = job["status"]["progress"]
    assert (progress["steps"], progress["warmup"], progress["finished"]) == (f"{total}/{total}", f"{warmup}/{warmup}", True)
    assert job["status"]["children"] == {"rayCluster": "tiny-a0", "podGroup": "tiny-a0",
                                         "submission": job["status"]["children"]["submission"]}
    assert condition(job, "Succeeded")["status"] == "True"
    assert condition(job, "GangScheduled")["observedGeneration"] == 1
    # Finished: nothing holds GPUs any more.
    wait_for("the RayCluster gone", lambda: kget(local_cluster, "rayclusters", ns, "tiny-a0") is None)
    # Finished: the trainer's identity is revoked, and its token with it.
    for kind in ("rolebindings", "roles", "serviceaccounts"):
        wait_for(f"the trainer's {kind} gone", lambda k=kind: kget(local_cluster, k, ns, "tiny-trainer") is None)
    (kubeconfig,) = operator.state_dir.glob(f"{ns}/tiny-*/a0/kubeconfig")
    as_trainer = {**local_cluster.env(), "KUBECONFIG": str(kubeconfig)}
    wait_for("the trainer's token refused", lambda: "unauthorized" in subprocess.run(
        [str(local_cluster.bin_dir / "kubectl"), "get", "ppojob", "tiny", "-n", ns], env=as_trainer,
        capture_output=True, text=True, check=False).stderr.lower(), timeout=30, interval=1)

    table = local_cluster.kubectl("get", "ppojobs", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "STEPS", "WARMUP", "STAGE", "OFFLOAD", "ETA", "AGE"]
    assert table[1].split()[:5] == ["tiny", "Succeeded", f"{total}/{total}", f"{warmup}/{warmup}", "Done"]
    described = local_cluster.kubectl("describe", "ppojob", "tiny", "-n", ns).stdout
    for reason in ("Created", "GangScheduled", "ClusterReady", "TrainerStarted", "CriticWarmupStep",
                   "CriticWarmupDone", "Training", "CheckpointWritten", "Succeeded", "ClusterDeleted"):
        assert reason in described, f"{reason} missing from kubectl describe:\n{described}"
    print("\n".join(table), "\n", described[described.index("Events:"):], sep="")
    assert "Traceback" not in operator.log()


def test_the_trainer_identity_may_report_to_its_own_progress_configmap_and_nothing_else(local_cluster, k8s_namespace, start_operator, tmp_path):
    ns = k8s_namespace
    operator = start_operator(STANDIN_HANG="1")  # the stand-in reports once, then only this test does
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 50}))
    apply(local_cluster, ns, tiny_manifest("other", resources={"gpusPerNode": 0}, scheduling={"gangScheduler": "None"}))
    wait_phase(local_cluster, ns, "tiny", "CriticWarmup", "Training", timeout=90)
    (kubeconfig,) = operator.state_dir.glob(f"{ns}/tiny-*/a0/kubeconfig")
    as_trainer = {**local_cluster.env(), "KUBECONFIG": str(kubeconfig)}

    def trainer_kubectl(*args):
        return subprocess.run([str(local_cluster.bin_dir / "kubectl"), *args, "-n", ns], env=as_trainer,
                              capture_output=True, text=True, check=False)

    report = json.dumps({"data": {"progress": json.dumps({"attempt": 0, "stage": "WeightSync", "step": 0})}})
    own = trainer_kubectl("patch", "configmap", "tiny-progress", "--type=merge", "-p", report)
    assert own.returncode == 0, own.stderr
    wait_for("the report folded into the status", lambda: (kget(local_cluster, "ppojob", ns, "tiny")["status"]
                                                           .get("progress", {}).get("stage")) == "WeightSync", timeout=15)
    status = json.dumps({"status": {"progress": {"stage": "Generate"}}})
    for args in (("patch", "configmap", "other-progress", "--type=merge", "-p", report),
                 ("patch", "ppojob", "tiny", "--subresource=status", "--type=merge", "-p", status),
                 ("patch", "ppojob", "tiny", "--type=merge", "-p", json.dumps({"spec": {"seed": 2}})),
                 ("get", "pods"), ("get", "ppojob", "other")):
        denied = trainer_kubectl(*args)
        assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), (args, denied.stderr)


def test_kubectl_get_and_describe_while_warming_up(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    start_operator(STANDIN_STEP_SECONDS="1.5")
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 12, "numCriticOnlySteps": 6}))
    wait_for("warm-up 2/6", lambda: ((kget(local_cluster, "ppojob", ns, "tiny") or {}).get("status") or {})
             .get("progress", {}).get("warmup") in ("2/6", "3/6"), timeout=90)
    row = local_cluster.kubectl("get", "ppo", "-n", ns, "--no-headers").stdout.split()
    assert row[0:2] == ["tiny", "CriticWarmup"] and row[3] in ("2/6", "3/6")
    assert "actor:off" in local_cluster.kubectl("get", "ppo", "tiny", "-n", ns, "-o", "wide").stdout
    described = local_cluster.kubectl("describe", "ppojob", "tiny", "-n", ns).stdout
    assert "critic-only warm-up 1/6 done" in described and re.search(r"\n\s+Phase:\s+CriticWarmup\n", described)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"ppo": {"numRollouts": 2, "numCriticOnlySteps": 3}}, "ppo.numCriticOnlySteps (3) must not exceed ppo.numRollouts (2)"),
        ({"ppo": {"numCriticOnlySteps": 1}, "critic": {"enabled": False}}, "ppo.numCriticOnlySteps > 0 needs a critic"),
        ({"placement": "Disaggregated"}, "placement Disaggregated needs GPUs of its own"),
        ({"rollout": {"gpus": 2}}, "placement Colocate runs the rollout engines on the training GPUs"),
        ({"resources": {"gpusPerNode": 3}, "critic": {"parallelism": {"tensor": 2}}},
         "must be a multiple of critic.parallelism.tensor * critic.parallelism.pipeline"),
        ({"resources": {"gpusPerNode": 2}, "critic": {"parallelism": {"data": 3}}}, "lower critic.parallelism.data"),
        ({"reward": {"type": "Custom"}}, "reward.type Custom needs reward.function"),
        ({"reward": {"type": "Model"}}, "reward.type Model needs reward.model.path"),
        ({"reward": {"type": "ExactAnswer", "model": {"path": "/rm"}}}, "reward.model is only used with reward.type Model"),
        ({"reward": {"type": "Model", "model": {"path": "/rm", "combine": "Gate"}}},
         "reward.model.combine Gate keeps the model's score only where a rule passes"),
        ({"reward": {"type": "Model", "model": {"path": "/rm", "combineWith": "Custom"}}},
         "reward.model.combineWith Custom needs reward.function"),
        ({"reward": {"type": "Model", "model": {"path": "/rm", "combineWith": "Remote"}}},
         "reward.model.combineWith Remote needs reward.remote.url"),
        ({"reward": {"type": "Model", "function": "m:f", "model": {"path": "/rm"}}},
         "reward.function is only called with reward.type Custom (or reward.model.combineWith Custom)"),
        ({"rollout": {"batchSize": 4}},  # 8 GPUs, 8 data ranks
         "a step's samples (rollout.batchSize * rollout.samplesPerPrompt) are fewer than the actor's data-parallel ranks"),
        ({"rollout": {"batchSize": 4}, "actor": {"parallelism": {"data": 2}}, "critic": {"parallelism": {"data": 8}}},
         "are fewer than the critic's data-parallel ranks"),
        ({"resources": {"gpusPerNode": 3}, "actor": {"parallelism": {"tensor": 2}}, "critic": {"parallelism": {"tensor": 2}}},
         "must be a multiple of actor.parallelism.tensor * actor.parallelism.pipeline"),
        ({"ppo": {"clipEps": 0.2, "clipEpsHigh": 0.1}}, "ppo.clipEpsHigh must be at least ppo.clipEps"),
        ({"ppo": {"schedule": "OneStepOverlap"}, "offload": {"rollout": False}},
         "ppo.schedule OneStepOverlap generates the next batch on the rollout engines while the current one trains"),
        ({"placement": "Disaggregated", "rollout": {"gpus": 1}, "ppo": {"schedule": "OneStepOverlap"},
          "offload": {"rollout": True}}, "so they never sleep: set offload.rollout to false"),
        ({"placement": "Disaggregated", "rollout": {"gpus": 1}, "offload": {"rollout": False},
          "ppo": {"schedule": "OneStepOverlap", "rolloutCorrection": {"type": "TruncatedImportanceSampling"}}},
         "ppo.schedule OneStepOverlap takes the PPO ratio against the engines' own log-probs"),
        ({"checkpoint": {"path": "/checkpoints", "volumeClaim": "ppo-checkpoints"}, "critic": {"save": "/critic"}},
         "critic.save must be a folder under checkpoint.path when checkpoint.volumeClaim is set"),
    ],
)
def test_each_cel_rule_rejects_with_its_message(local_cluster, ppojob_crd, k8s_namespace, spec, message):
    result = apply_bad(local_cluster, k8s_namespace, spec)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_a_critic_on_the_actors_layout_is_refused_with_the_actors_message_alone(local_cluster, ppojob_crd, k8s_namespace):
    result = apply_bad(local_cluster, k8s_namespace, {"rollout": {"batchSize": 4}})  # 8 GPUs, 8 data ranks for both roles
    assert result.returncode != 0 and "are fewer than the actor's" in result.stderr, result.stderr
    assert "critic" not in result.stderr, result.stderr


def apply_bad(local_cluster, namespace: str, spec: dict):
    """`kubectl apply` of the tiny job with `spec`'s sections, left to fail."""
    manifest = tiny_manifest("bad", **spec)
    return local_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False)
