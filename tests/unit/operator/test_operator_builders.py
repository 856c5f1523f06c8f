"""Builders return whole manifests; each test compares an entire object built from make_ppojob."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml
from operator_factory import make_job

from ppo_operator.builders.common import BuildOptions, gang_of
from ppo_operator.builders.network_policy import build_network_policy
from ppo_operator.builders.pod_group import build_pod_group
from ppo_operator.builders.ray_token import build_ray_token_secret
from ppo_operator.builders.raycluster import TRAINER_UID, build_raycluster
from ppo_operator.builders.rbac import (
    build_kubeconfig,
    build_progress_configmap,
    build_role,
    build_role_binding,
    build_service_account,
)
from ppo_operator.builders.submission import build_submission
from ppo_operator.gang import backend_for
from ppo_operator.main import build_options, parse_args
from ppojob_api.vocabulary import GangScheduler

OWNER = {
    "apiVersion": "ppojob.io/v1alpha1", "kind": "PPOJob", "name": "tiny", "uid": "1234-abcd",
    "controller": True, "blockOwnerDeletion": True,
}
JOB_LABELS = {"ppojob.io/job-name": "tiny", "app.kubernetes.io/managed-by": "ppojob-operator"}
ATTEMPT0 = {**JOB_LABELS, "ppojob.io/attempt": "0"}
OPTIONS = BuildOptions()


def _pod(role, container, resources, *, gang_labels=None, scheduler="scheduler-plugins-scheduler", attempt="0", extra_spec=None, volumes=None, mounts=None, env_from=None, grace=300):
    stop = ["head", "--pid-file", "/tmp/ppo-trainer.pid"] if role == "head" else ["worker"]
    pod_container = {
        "name": container,
        "image": "ppojob/trainer:test",
        "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": resources, "limits": resources},
        "env": [
            {"name": "PPOJOB_NAME", "value": "tiny"},
            {"name": "PPOJOB_NAMESPACE", "value": "team-a"},
            {"name": "PPOJOB_ATTEMPT", "value": attempt},
            {"name": "PPOJOB_PROGRESS_CONFIGMAP", "value": "tiny-progress"},
            {"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tiny-ray-token", "key": "token"}}},
        ],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *(mounts or [])],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        # KubeRay's PID 1 loses the SIGTERM: the hook stops the trainer with a checkpoint, then the container
        "lifecycle": {"preStop": {"exec": {"command": ["python", "-m", "ppo_trainer.graceful_stop", *stop]}}},
    }
    if env_from:
        pod_container["envFrom"] = env_from
    spec = {
        "serviceAccountName": "tiny-trainer",
        "automountServiceAccountToken": role == "head",  # the trainer's reporter runs in the driver, on the head
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": grace,
        "containers": [pod_container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}, *(volumes or [])],
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    spec.update(extra_spec or {})
    labels = {**JOB_LABELS, "ppojob.io/attempt": attempt, "ppojob.io/role": role}
    labels.update({"scheduling.x-k8s.io/pod-group": f"tiny-a{attempt}"} if gang_labels is None else gang_labels)
    return {"metadata": {"labels": labels}, "spec": spec}


HEAD_RES = {"cpu": "2", "memory": "8Gi"}
TRAIN_RES = {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "4"}


def _group(name, replicas, template):
    return {"groupName": name, "replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas,
            "rayStartParams": {}, "template": template}


def test_build_raycluster_colocated_coscheduling_is_the_whole_object():
    job = make_job()
    spec, _ = job.parse()
    got = build_raycluster(job, spec, attempt=0, backend=backend_for(GangScheduler.COSCHEDULING), options=OPTIONS)
    assert got == {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "tiny-a0", "namespace": "team-a", "labels": ATTEMPT0, "ownerReferences": [OWNER]},
        "spec": {
            "rayVersion": "2.60.0",
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                "template": _pod("head", "ray-head", HEAD_RES),
            },
            "workerGroupSpecs": [_group("train", 2, _pod("train", "ray-worker", TRAIN_RES))],
        },
    }


def test_build_raycluster_disaggregated_with_volume_secret_grace_and_placement_constraints():
    job = make_job(
        placement="Disaggregated", rollout={"gpus": 6},
        checkpoint={"volumeClaim": "ckpt", "path": "/ckpt", "terminationGracePeriodSeconds": 60},
        envFromSecret="hf-token", scheduling={"priorityClassName": "high"},
        resources={"nodeSelector": {"pool": "h200"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    )
    spec, problem = job.parse()
    assert problem is None
    got = build_raycluster(job, spec, attempt=3, backend=backend_for(GangScheduler.COSCHEDULING), options=OPTIONS)
    pod_kwargs = {
        "attempt": "3",
        "extra_spec": {"priorityClassName": "high", "nodeSelector": {"pool": "h200"},
                    "tolerations": [{"key": "gpu", "operator": "Exists"}]},
        "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}}],
        "mounts": [{"name": "checkpoints", "mountPath": "/ckpt"}],
        "env_from": [{"secretRef": {"name": "hf-token"}}],
        "grace": 60,
    }
    assert got == {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "tiny-a3", "namespace": "team-a", "labels": {**JOB_LABELS, "ppojob.io/attempt": "3"},
                     "ownerReferences": [OWNER]},
        "spec": {
            "rayVersion": "2.60.0",
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                "template": _pod("head", "ray-head", HEAD_RES, **pod_kwargs),
            },
            "workerGroupSpecs": [
                _group("train", 2, _pod("train", "ray-worker", TRAIN_RES, **pod_kwargs)),
                # 6 rollout GPUs on 4-GPU nodes: 2 pods of 3 GPUs.
                _group("rollout", 2, _pod("rollout", "ray-worker", {**TRAIN_RES, "nvidia.com/gpu": "3"}, **pod_kwargs)),
            ],
        },
    }


def test_build_raycluster_for_kueue_is_suspended_and_queued_with_the_default_scheduler():
    job = make_job(scheduling={"gangScheduler": "Kueue", "queue": "team-a-queue"})
    spec, _ = job.parse()
    got = build_raycluster(job, spec, attempt=0, backend=backend_for(GangScheduler.KUEUE), options=OPTIONS)
    assert got["metadata"]["labels"] == {**ATTEMPT0, "kueue.x-k8s.io/queue-name": "team-a-queue"}
    assert got["spec"]["suspend"] is True
    assert got["spec"]["headGroupSpec"]["template"] == _pod("head", "ray-head", HEAD_RES, gang_labels={}, scheduler=None)


def test_build_raycluster_without_gang_scheduler_has_no_gang_fields():
    job = make_job(scheduling={"gangScheduler": "None"}, resources={"gpusPerNode": 0})
    spec, _ = job.parse()
    got = build_raycluster(job, spec, attempt=0, backend=backend_for(GangScheduler.NONE), options=OPTIONS)
    worker = got["spec"]["workerGroupSpecs"][0]["template"]
    assert worker == _pod("train", "ray-worker", {"cpu": "8", "memory": "32Gi"}, gang_labels={}, scheduler=None)
    assert "suspend" not in got["spec"]


def test_build_pod_group_coscheduling_counts_every_pod_and_gpu():
    job = make_job(scheduling={"scheduleTimeoutSeconds": 90})
    spec, _ = job.parse()
    assert build_pod_group(job, spec, attempt=1, backend=backend_for(GangScheduler.COSCHEDULING)) == {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": {"name": "tiny-a1", "namespace": "team-a", "labels": {**JOB_LABELS, "ppojob.io/attempt": "1"},
                     "ownerReferences": [OWNER]},
        "spec": {"minMember": 3, "scheduleTimeoutSeconds": 90, "minResources": {"nvidia.com/gpu": "8"}},
    }


def test_kueue_and_none_build_no_pod_group():
    for scheduler in ("Kueue", "None"):
        job = make_job(scheduling={"gangScheduler": scheduler, "queue": "q"})
        spec, _ = job.parse()
        assert build_pod_group(job, spec, attempt=0, backend=backend_for(GangScheduler(scheduler))) is None


def test_gang_of_disaggregated_counts_rollout_pods():
    job = make_job(placement="Disaggregated", rollout={"gpus": 4})
    spec, _ = job.parse()
    gang = gang_of(job, spec, 0)
    assert (gang.name, gang.min_member, gang.gpus) == ("tiny-a0", 4, 12)


def test_scheduler_name_can_be_overridden_per_backend():
    backend = backend_for(GangScheduler.COSCHEDULING, {GangScheduler.COSCHEDULING: "gang-scheduler"})
    assert backend.scheduler_name == "gang-scheduler"


def test_rbac_objects_let_the_trainer_report_to_its_own_progress_configmap_only():
    job = make_job()
    meta = {"name": "tiny-trainer", "namespace": "team-a", "labels": JOB_LABELS, "ownerReferences": [OWNER]}
    assert build_service_account(job) == {
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": True,
    }
    assert build_role(job) == {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta,
        "rules": [
            {"apiGroups": ["ppojob.io"], "resources": ["ppojobs"], "resourceNames": ["tiny"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["tiny-progress"],
             "verbs": ["get", "patch"]},
        ],
    }
    assert build_progress_configmap(job) == {
        "apiVersion": "v1", "kind": "ConfigMap", "data": {},
        "metadata": {**meta, "name": "tiny-progress"},
    }
    assert build_role_binding(job) == {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tiny-trainer"},
        "subjects": [{"kind": "ServiceAccount", "name": "tiny-trainer", "namespace": "team-a"}],
    }


def test_build_kubeconfig_holds_only_the_token():
    assert build_kubeconfig(server="https://127.0.0.1:6443", ca_data="Q0E=", token="t0k", namespace="team-a") == {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "ppojob", "cluster": {"server": "https://127.0.0.1:6443", "certificate-authority-data": "Q0E="}}],
        "users": [{"name": "trainer", "user": {"token": "t0k"}}],
        "contexts": [{"name": "trainer", "context": {"cluster": "ppojob", "user": "trainer", "namespace": "team-a"}}],
        "current-context": "trainer",
    }


def test_build_submission_is_deterministic_per_attempt_and_resumes_after_the_first():
    job = make_job()
    first = build_submission(job, attempt=0, run_dir="/checkpoints", options=OPTIONS)
    again = build_submission(job, attempt=0, run_dir="/checkpoints", options=OPTIONS)
    second = build_submission(job, attempt=1, run_dir="/checkpoints", options=OPTIONS)
    assert first == again
    assert first["submission_id"] == "ppojob-1234-abcd-a0" and second["submission_id"] == "ppojob-1234-abcd-a1"
    assert first["entrypoint"].endswith(
        "exec bash -c 'exec > >(tee -a /proc/1/fd/1) 2>&1; "
        "exec ppo-train /tmp/ppojob-1234-abcd-a0.yaml --address auto --run-dir /checkpoints --pid-file /tmp/ppo-trainer.pid'"
    ) and second["entrypoint"].endswith("--resume'")
    encoded = first["entrypoint"].split()[1]
    manifest = yaml.safe_load(base64.b64decode(encoded))
    assert manifest["kind"] == "PPOJob" and manifest["spec"]["image"] == "ppojob/trainer:test"
    assert first["runtime_env"] == {"env_vars": {"PPOJOB_ATTEMPT": "0"}}


def test_a_spec_is_parsed_once_per_content_and_a_bad_one_still_names_its_field():
    first, same, other = make_job(), make_job(name="another"), make_job(ppo={"numRollouts": 7})
    assert first.parse()[0] is same.parse()[0]  # equal specs share one parse
    assert other.parse()[0].ppo.num_rollouts == 7 and other.parse()[0] is not first.parse()[0]
    spec, problem = make_job(ppo={"numRollouts": -1}).parse()
    assert spec is None and "ppo.numRollouts" in problem


def test_build_ray_token_secret_holds_the_token_under_its_key():
    assert build_ray_token_secret(make_job(), token="t0k") == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "tiny-ray-token", "namespace": "team-a", "labels": JOB_LABELS, "ownerReferences": [OWNER]},
        "type": "Opaque",
        "stringData": {"token": "t0k"},
    }


def test_build_network_policy_admits_the_jobs_pods_anywhere_and_the_operator_to_the_dashboard():
    options = BuildOptions(operator_namespace="ppojob-system",
                           operator_pod_labels=(("app.kubernetes.io/name", "ppojob-operator"),
                                                ("app.kubernetes.io/instance", "ppojob")))
    job_pods = {"matchLabels": {"ppojob.io/job-name": "tiny"}}
    assert build_network_policy(make_job(), options=options) == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "tiny-ray-ingress", "namespace": "team-a", "labels": JOB_LABELS, "ownerReferences": [OWNER]},
        "spec": {
            "podSelector": job_pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": job_pods}]},
                {
                    "from": [{
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ppojob-system"}},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ppojob-operator",
                                                        "app.kubernetes.io/instance": "ppojob"}},
                    }],
                    "ports": [{"protocol": "TCP", "port": 8265}],
                },
            ],
        },
    }


def test_build_network_policy_of_an_operator_outside_the_cluster_admits_the_jobs_pods_only():
    policy = build_network_policy(make_job(name="a" * 60), options=OPTIONS)
    selector = {"matchLabels": {"ppojob.io/job-name": policy["metadata"]["labels"]["ppojob.io/job-name"]}}
    assert policy["spec"] == {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": selector}]}]}
    assert len(selector["matchLabels"]["ppojob.io/job-name"]) <= 63  # the label value the pods carry, shortened


def pod_templates(cluster: dict) -> list[dict]:
    return [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]


def as_kuberay_builds_it(template: dict) -> dict:
    """The pod spec with KubeRay v1.5.0's wait-gcs-ready init container, which copies the Ray
    container's securityContext, env and mounts (controllers/ray/common/pod.go, DefaultWorkerPodTemplate)."""
    spec = dict(template["spec"])
    (ray,) = spec["containers"]
    init = {"name": "wait-gcs-ready", "image": ray["image"], "securityContext": ray.get("securityContext"),
            "env": ray["env"], "volumeMounts": ray["volumeMounts"]}
    return {**spec, "initContainers": [init]}


def restricted_violations(pod: dict) -> list[str]:
    """What the `restricted` Pod Security Standard (v1.34) refuses in a pod spec."""
    found = []
    pod_context = pod.get("securityContext") or {}
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
    for volume in pod.get("volumes", []):
        found += [f"volume {volume['name']}: {kind}" for kind in volume if kind != "name" and kind not in allowed_volumes]
    found += [f"pod: {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    for container in pod["containers"] + pod.get("initContainers", []):
        context, name = container.get("securityContext") or {}, container["name"]
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation")
        if "ALL" not in (context.get("capabilities") or {}).get("drop", []):
            found.append(f"{name}: capabilities not dropped")
        if set((context.get("capabilities") or {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if not context.get("runAsNonRoot", pod_context.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
        found += [f"{name}: hostPort" for port in container.get("ports", []) if port.get("hostPort")]
    return found


def test_every_ray_pod_passes_the_restricted_pod_security_standard_as_kuberay_builds_it():
    job = make_job(placement="Disaggregated", rollout={"gpus": 4}, checkpoint={"volumeClaim": "ckpt"})
    spec, _ = job.parse()
    cluster = build_raycluster(job, spec, attempt=0, backend=backend_for(GangScheduler.COSCHEDULING), options=OPTIONS)
    templates = pod_templates(cluster)
    assert len(templates) == 3
    for template in templates:
        assert restricted_violations(as_kuberay_builds_it(template)) == []
    bare = {"containers": [{"name": "ray-head"}], "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}
    assert len(restricted_violations(bare)) == 5  # the check itself refuses what restricted refuses


def test_only_the_head_mounts_a_service_account_token():
    job = make_job(placement="Disaggregated", rollout={"gpus": 4})
    spec, _ = job.parse()
    cluster = build_raycluster(job, spec, attempt=0, backend=backend_for(GangScheduler.COSCHEDULING), options=OPTIONS)
    mounts = {t["metadata"]["labels"]["ppojob.io/role"]: t["spec"]["automountServiceAccountToken"] for t in pod_templates(cluster)}
    assert mounts == {"head": True, "train": False, "rollout": False}


def test_pods_run_as_the_trainer_images_user():
    dockerfile = (Path(__file__).resolve().parents[3] / "images" / "trainer" / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)
    assert user == (str(TRAINER_UID), str(TRAINER_UID))


def test_the_operators_pods_are_known_from_pod_namespace_and_its_label_flags(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "ppojob-system")
    args = parse_args(["--operator-pod-label", "app.kubernetes.io/name=ppojob-operator",
                       "--operator-pod-label", "app.kubernetes.io/instance=ppojob"])
    options = build_options(args)
    assert options.operator_namespace == "ppojob-system"
    assert options.operator_pod_labels == (("app.kubernetes.io/name", "ppojob-operator"), ("app.kubernetes.io/instance", "ppojob"))
    monkeypatch.delenv("POD_NAMESPACE")
    assert build_options(parse_args([])).operator_namespace is None  # outside the cluster
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        build_options(parse_args(["--operator-pod-label", "no-value"]))
