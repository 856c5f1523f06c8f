"""The local cluster behaves like a real one: version, CRD schema validation, GPU scheduling on
fake nodes, all-or-nothing gang scheduling, KubeRay, garbage collection, tokens and impersonation."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest

from local_cluster import GANG_SCHEDULER_NAME, load_pins

pytestmark = pytest.mark.cluster


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def get_json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def gpu_pod(name: str, gpus: int, **extra_spec) -> str:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": extra_spec.pop("labels", {})},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/trainer:none",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
            **extra_spec,
        },
    }
    return json.dumps(pod)


def test_kubectl_version_reports_real_server_version(local_cluster):
    version = json.loads(local_cluster.kubectl("version", "-o", "json").stdout)
    pins = load_pins()
    expected = pins.kubernetes
    assert version["serverVersion"]["gitVersion"] == expected
    assert version["clientVersion"]["gitVersion"] == expected
    assert version["serverVersion"]["minor"] == expected.split(".")[1]
    binary = subprocess.run(
        [str(local_cluster.bin_dir / "kube-apiserver"), "--version"], capture_output=True, text=True, check=True
    )
    assert binary.stdout.strip() == f"Kubernetes {expected}"
    assert local_cluster.helm("version", "--short").stdout.strip().split("+")[0] == pins["HELM_VERSION"]


def test_crd_schema_rejects_invalid_object_with_apiserver_message(local_cluster):
    group = f"t{uuid.uuid4().hex[:8]}.ppojob.test"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["replicas"],
                                    "properties": {"replicas": {"type": "integer", "minimum": 1}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    local_cluster.apply(json.dumps(crd))
    try:
        local_cluster.wait_established(f"widgets.{group}")
        good = {
            "apiVersion": f"{group}/v1",
            "kind": "Widget",
            "metadata": {"name": "ok", "namespace": "default"},
            "spec": {"replicas": 2},
        }
        local_cluster.apply(json.dumps(good))
        bad = dict(good, metadata={"name": "bad", "namespace": "default"}, spec={"replicas": "many"})
        result = local_cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
        assert result.returncode != 0
        assert "spec.replicas" in result.stderr
        assert "must be of type integer" in result.stderr, result.stderr
        zero = dict(good, metadata={"name": "zero", "namespace": "default"}, spec={"replicas": 0})
        result = local_cluster.kubectl("apply", "-f", "-", input=json.dumps(zero), check=False)
        assert result.returncode != 0
        assert "should be greater than or equal to 1" in result.stderr, result.stderr
    finally:
        local_cluster.kubectl("delete", "crd", f"widgets.{group}", "--ignore-not-found", check=False)


def test_gpu_pod_runs_on_fake_node_and_oversized_one_stays_pending(local_cluster, k8s_namespace):
    ns = k8s_namespace
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input=gpu_pod("eight", 8))
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input=gpu_pod("too-many", 64))
    local_cluster.kubectl("wait", "-n", ns, "--for=jsonpath={.status.phase}=Running", "pod/eight", "--timeout=90s")
    pod = get_json(local_cluster, "-n", ns, "pod/eight")
    node = get_json(local_cluster, "node", pod["spec"]["nodeName"])
    assert node["metadata"]["annotations"].get("kwok.x-k8s.io/node") == "fake"
    assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 8

    def unschedulable():
        p = get_json(local_cluster, "-n", ns, "pod/too-many")
        for cond in p["status"].get("conditions", []):
            if cond["type"] == "PodScheduled" and cond["status"] == "False" and cond.get("reason") == "Unschedulable":
                return p, cond
        return None

    p, cond = wait_until(unschedulable, 60, "the scheduler to mark pod/too-many Unschedulable")
    assert p["status"]["phase"] == "Pending"
    assert not p["spec"].get("nodeName")
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    events = local_cluster.kubectl(
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        "involvedObject.name=too-many,reason=FailedScheduling",
        "-o",
        "json",
    ).stdout
    assert json.loads(events)["items"], "no FailedScheduling event for pod/too-many"


def test_gang_keeps_all_members_unbound_until_all_fit(local_cluster, k8s_namespace):
    ns = k8s_namespace
    pool = f"gang-{uuid.uuid4().hex[:6]}"
    nodes = [f"{pool}-{i}" for i in range(3)]
    members = [f"member-{i}" for i in range(3)]
    try:
        for node in nodes[:2]:  # room for two of the three 8-GPU members
            local_cluster.add_fake_node(node, gpus=8, labels={"ppojob.test/pool": pool})
        local_cluster.apply(
            json.dumps(
                {
                    "apiVersion": "scheduling.x-k8s.io/v1alpha1",
                    "kind": "PodGroup",
                    "metadata": {"name": "gang", "namespace": ns},
                    "spec": {"minMember": 3, "scheduleTimeoutSeconds": 300},
                }
            )
        )
        for name in members:
            local_cluster.kubectl(
                "apply",
                "-n",
                ns,
                "-f",
                "-",
                input=gpu_pod(
                    name,
                    8,
                    labels={"scheduling.x-k8s.io/pod-group": "gang"},
                    schedulerName=GANG_SCHEDULER_NAME,
                    nodeSelector={"ppojob.test/pool": pool},
                ),
            )

        def bound() -> list[str]:
            items = get_json(local_cluster, "-n", ns, "pods")["items"]
            return [p["metadata"]["name"] for p in items if p["spec"].get("nodeName")]

        # Two members fit and wait at Permit; the third does not: no member may be bound meanwhile.
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            assert bound() == [], f"partial gang start: {bound()} bound while the group cannot fit"
            time.sleep(1)
        events = local_cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
        reasons = {e["reason"] for e in json.loads(events)["items"]}
        assert "FailedScheduling" in reasons, reasons

        local_cluster.add_fake_node(nodes[2], gpus=8, labels={"ppojob.test/pool": pool})
        # The members Coscheduling rejected wait in the unschedulable queue for a Pod or PodGroup event
        # (it registers no node events) or the queue's flush, 30 s on the local cluster (cluster.py):
        # a label on the PodGroup is such an event, so they are tried again at once.
        local_cluster.kubectl("label", "podgroup", "gang", "-n", ns, "ppojob.test/capacity=added")
        wait_until(lambda: len(bound()) == 3, 120, "all gang members to be bound once capacity appeared")
        for name in members:
            local_cluster.kubectl(
                "wait", "-n", ns, "--for=jsonpath={.status.phase}=Running", f"pod/{name}", "--timeout=60s"
            )
        placed = {get_json(local_cluster, "-n", ns, f"pod/{m}")["spec"]["nodeName"] for m in members}
        assert placed == set(nodes)
    finally:
        local_cluster.kubectl("delete", "pods", "--all", "-n", ns, "--wait=true", "--timeout=60s", check=False)
        for node in nodes:
            local_cluster.delete_node(node)


def test_raycluster_gets_head_and_worker_pods_from_kuberay(local_cluster, k8s_namespace):
    ns = k8s_namespace
    container = {
        "name": "ray",
        "image": "rayproject/ray:2.49.0",
        "resources": {"limits": {"cpu": "1", "memory": "2Gi"}},
    }
    worker = dict(container, resources={"limits": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": "1"}})
    raycluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "rc", "namespace": ns, "labels": {"ray.io/gang-scheduling-enabled": "true"}},
        "spec": {
            "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [container]}}},
            "workerGroupSpecs": [
                {
                    "groupName": "gpu",
                    "replicas": 2,
                    "minReplicas": 2,
                    "maxReplicas": 2,
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [worker]}},
                }
            ],
        },
    }
    local_cluster.apply(json.dumps(raycluster))

    def pods():
        items = get_json(local_cluster, "-n", ns, "pods", "-l", "ray.io/cluster=rc")["items"]
        running = [p for p in items if p["status"].get("phase") == "Running"]
        return items if len(items) == 3 and len(running) == 3 else None

    items = wait_until(pods, 120, "KubeRay's head and 2 worker pods to be Running")
    kinds = sorted(p["metadata"]["labels"]["ray.io/node-type"] for p in items)
    assert kinds == ["head", "worker", "worker"]
    for p in items:
        assert p["spec"]["schedulerName"] == GANG_SCHEDULER_NAME
        node = get_json(local_cluster, "node", p["spec"]["nodeName"])
        assert node["metadata"]["annotations"].get("kwok.x-k8s.io/node") == "fake"
    pg = get_json(local_cluster, "-n", ns, "podgroup/rc")
    assert pg["spec"]["minMember"] == 3
    wait_until(
        lambda: get_json(local_cluster, "-n", ns, "raycluster/rc").get("status", {}).get("state") == "ready",
        60,
        "RayCluster rc to report state ready",
    )
    local_cluster.kubectl("delete", "raycluster", "rc", "-n", ns, "--wait=true", "--timeout=60s")


def test_deleting_owner_garbage_collects_owned_objects(local_cluster, k8s_namespace):
    ns = k8s_namespace
    local_cluster.kubectl("create", "configmap", "owner", "-n", ns)
    owner_uid = get_json(local_cluster, "-n", ns, "configmap/owner")["metadata"]["uid"]
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "namespace": ns,
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}],
        },
    }
    local_cluster.apply(json.dumps(owned))
    local_cluster.kubectl("create", "deployment", "web", "-n", ns, "--image=registry.invalid/web:none", "--replicas=2")
    wait_until(
        lambda: len(get_json(local_cluster, "-n", ns, "pods", "-l", "app=web")["items"]) == 2,
        60,
        "the Deployment's ReplicaSet to create 2 pods",
    )
    local_cluster.kubectl("delete", "configmap", "owner", "-n", ns)
    local_cluster.kubectl("delete", "deployment", "web", "-n", ns)  # background propagation by default

    def gone():
        cms = local_cluster.kubectl("get", "configmap", "owned", "-n", ns, check=False)
        rs = get_json(local_cluster, "-n", ns, "replicasets")["items"]
        pods = get_json(local_cluster, "-n", ns, "pods", "-l", "app=web")["items"]
        return cms.returncode != 0 and "NotFound" in cms.stderr and not rs and not pods

    wait_until(gone, 90, "the garbage collector to delete the owned ConfigMap, ReplicaSet and pods")


def test_service_account_token_and_impersonation(local_cluster, k8s_namespace, tmp_path):
    ns = k8s_namespace
    local_cluster.kubectl("create", "serviceaccount", "reporter", "-n", ns)
    sa = f"system:serviceaccount:{ns}:reporter"
    # The admin may impersonate; RBAC denies the bare service account.
    denied = local_cluster.kubectl("get", "pods", "-n", ns, f"--as={sa}", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    local_cluster.kubectl("create", "role", "pod-reader", "-n", ns, "--verb=get,list", "--resource=pods")
    local_cluster.kubectl(
        "create", "rolebinding", "reporter", "-n", ns, "--role=pod-reader", f"--serviceaccount={ns}:reporter"
    )
    wait_until(
        lambda: local_cluster.kubectl("get", "pods", "-n", ns, f"--as={sa}", check=False).returncode == 0,
        30,
        "RBAC to allow the impersonated service account",
    )
    token = local_cluster.create_token("reporter", ns, duration="10m")
    kubeconfig = local_cluster.kubeconfig_for_token(token, tmp_path / "reporter.kubeconfig")
    whoami = local_cluster.kubectl("auth", "whoami", "-o", "json", f"--kubeconfig={kubeconfig}")
    assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == sa
    listed = local_cluster.kubectl("get", "pods", "-n", ns, f"--kubeconfig={kubeconfig}")
    assert listed.returncode == 0
