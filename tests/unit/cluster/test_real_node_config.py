"""The real node's configuration files (tools/cluster/local_cluster/node.py): what each must hold for
pods to run on these machines and for nothing they send to leave it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import yaml

from local_cluster import node

PATHS = node.NodePaths(Path("/state/node"))
PKI = Path("/state/pki")


def test_containerd_runs_runc_with_cgroupfs_and_may_not_lower_oom_scores():
    config = tomllib.loads(node.containerd_config(PATHS, sandbox_image="localhost/pause:1"))
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["sandbox_image"] == "localhost/pause:1"
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["runtime_type"] == "io.containerd.runc.v2"
    assert runc["options"]["SystemdCgroup"] is False  # the kubelet's cgroupDriver is cgroupfs
    assert cri["cni"]["conf_dir"] == str(PATHS.cni_conf_dir)
    for key in ("root", "state"):  # nothing under /var/lib or /run of the machine
        assert config[key].startswith("/state/node/")
    assert config["grpc"]["address"] == str(PATHS.containerd_socket)


def test_kubelet_matches_the_runtime_and_keeps_off_the_fake_gpu_tests():
    config = yaml.safe_load(node.kubelet_config(PATHS, PKI))
    assert config["cgroupDriver"] == "cgroupfs" and config["failCgroupV1"] is False
    assert config["containerRuntimeEndpoint"] == f"unix://{PATHS.containerd_socket}"
    assert config["registerWithTaints"] == [node.NODE_TAINT]
    assert config["clusterDNS"] == [node.BRIDGE_ADDRESS]
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["authorization"]["mode"] == "Webhook"
    assert config["imageGCHighThresholdPercent"] == 100  # images cannot be pulled again here


def test_pods_get_no_default_route():
    network = json.loads(node.cni_config(PATHS))
    bridge = network["plugins"][0]
    assert bridge["type"] == "bridge" and bridge["isGateway"] is False and bridge["ipMasq"] is False
    routes = bridge["ipam"]["routes"]
    assert routes == [{"dst": node.SERVICE_CIDR, "gw": node.BRIDGE_ADDRESS}]
    assert all(r["dst"] not in ("0.0.0.0/0", "default") for r in routes)
    assert [p["type"] for p in network["plugins"]] == ["bridge", "portmap"]


def test_cluster_dns_forwards_nothing():
    corefile = node.corefile(Path("/state/kubeconfig"))
    assert "forward" not in corefile and "proxy" not in corefile
    assert f"bind {node.BRIDGE_ADDRESS}" in corefile


def test_kube_proxy_serves_node_ports_on_the_bridge_only():
    config = yaml.safe_load(node.kube_proxy_config(Path("/state/kp.kubeconfig")))
    assert config["mode"] == "iptables"
    assert config["nodePortAddresses"] == [f"{node.BRIDGE_ADDRESS}/32"]
    assert config["hostnameOverride"] == node.NODE_NAME
