"""The objects and config files the local cluster is set up with: fake GPU nodes, scheduler
configurations, and the CRD files of KubeRay and scheduler-plugins (read from the Go module cache)."""

from __future__ import annotations

import json
from pathlib import Path

from . import build as builder
from .pins import Pins

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"

CRD_NAMES = (
    "rayclusters.ray.io",
    "rayjobs.ray.io",
    "rayservices.ray.io",
    "podgroups.scheduling.x-k8s.io",
    "elasticquotas.scheduling.x-k8s.io",
)


def node_name(index: int) -> str:
    return f"kwok-gpu-{index}"


def fake_node(name: str, gpus: int, cpu: str, memory: str, labels: dict[str, str] | None = None) -> str:
    """A Node that KWOK manages (annotation) advertising `gpus` nvidia.com/gpu, as JSON (valid YAML)."""
    resources = {
        "cpu": str(cpu),
        "memory": str(memory),
        "pods": "110",
        GPU_RESOURCE: str(gpus),
        "ephemeral-storage": "1Ti",
    }
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                **(labels or {}),
            },
        },
        "spec": {},
        "status": {
            "allocatable": resources,
            "capacity": resources,
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "fake"},
        },
    }
    return json.dumps(node, indent=2)


def fake_nodes(pins_values: dict[str, str]) -> str:
    count = int(pins_values.get("FAKE_NODE_COUNT", 4))
    docs = [
        fake_node(
            node_name(i),
            int(pins_values.get("FAKE_NODE_GPUS", 8)),
            pins_values.get("FAKE_NODE_CPU", "64"),
            pins_values.get("FAKE_NODE_MEMORY", "512Gi"),
        )
        for i in range(count)
    ]
    return "\n---\n".join(docs) + "\n"


def crd_files(pins: Pins) -> list[Path]:
    """KubeRay's CRDs and scheduler-plugins' PodGroup and ElasticQuota CRDs, straight from the module cache (never copied into the repo)."""
    kuberay = builder.module_dir(pins, builder.KUBERAY_MODULE)
    plugins = builder.module_dir(pins, builder.SCHEDULER_PLUGINS_MODULE)
    files = [
        kuberay / "config" / "crd" / "bases" / f"ray.io_{kind}.yaml"
        for kind in ("rayclusters", "rayjobs", "rayservices")
    ]
    files.append(plugins / "manifests" / "coscheduling" / "crd.yaml")
    # The scheduler-plugins controller also watches ElasticQuota; without its CRD it exits.
    files.append(plugins / "manifests" / "capacityscheduling" / "crd.yaml")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise builder.BuildError(f"CRD files missing from the Go module cache: {', '.join(missing)}")
    return files


KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/general/pod-create.yaml",
    "pod/general/pod-init-container-running.yaml",
    "pod/general/pod-init-container-completed.yaml",
    "pod/general/pod-ready.yaml",
    "pod/general/pod-complete.yaml",
    "pod/general/pod-delete.yaml",
)


def kwok_stage_files(pins: Pins) -> list[Path]:
    """KWOK's own node and pod lifecycle Stages (module cache): nodes become Ready and heartbeat, bound
    pods go Pending -> Running (Succeeded for Job pods), deleted pods go away."""
    root = builder.module_dir(pins, builder.KWOK_MODULE) / "kustomize" / "stage"
    files = [root / rel for rel in KWOK_STAGES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise builder.BuildError(f"KWOK stage files missing from the Go module cache: {', '.join(missing)}")
    return files


def scheduler_config(kubeconfig: Path, gang_profile: str | None) -> str:
    """KubeSchedulerConfiguration: the default profile, or only the coscheduling profile `gang_profile`."""
    head = (
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
        f"clientConnection:\n  kubeconfig: {kubeconfig}\nleaderElection:\n  leaderElect: false\n"
    )
    if gang_profile is None:
        return head
    return head + (
        f"profiles:\n- schedulerName: {gang_profile}\n"
        "  plugins:\n    multiPoint:\n      enabled:\n      - name: Coscheduling\n"
        '    queueSort:\n      enabled:\n      - name: Coscheduling\n      disabled:\n      - name: "*"\n'
        "  pluginConfig:\n  - name: Coscheduling\n    args:\n      permitWaitingTimeSeconds: 10\n"
    )
