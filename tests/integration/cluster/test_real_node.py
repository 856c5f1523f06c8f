"""The local cluster's real node: pods run in containers (kubelet, containerd, runc), reach each other
through Services and cluster DNS, reach the API server with their ServiceAccount token, pass the
`restricted` Pod Security Standard, are guarded by NetworkPolicies, and have no route off the
machine; fake-GPU pods stay on KWOK."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from local_cluster import images, network_policies, node

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
ON_REAL_NODE = {
    "nodeSelector": {node.NODE_LABEL: "true"},
    "tolerations": [{"key": node.NODE_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
}


def python_pod(name: str, code: str, *, labels: dict | None = None, restart: str = "Never") -> str:
    """A pod of the operator image (it has Python) that runs `code`, restricted, on the real node."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            **ON_REAL_NODE, "restartPolicy": restart, "securityContext": RESTRICTED_POD,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": images.OPERATOR_IMAGE, "imagePullPolicy": "Never",
                            "command": ["python3", "-c", textwrap.dedent(code)],
                            "securityContext": RESTRICTED_CONTAINER}],
        },
    })


def wait_for_phase(cluster, namespace: str, name: str, phases: tuple[str, ...], timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = json.loads(cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)
        if pod["status"].get("phase") in phases:
            return pod
        time.sleep(0.5)
    events = cluster.kubectl("get", "events", "-n", namespace, check=False).stdout
    raise AssertionError(f"pod {name} not {phases} within {timeout}s: {pod['status']}\n{events}")


@pytest.fixture
def restricted_namespace(local_cluster, k8s_namespace, real_node_images):
    local_cluster.kubectl("label", "namespace", k8s_namespace, "pod-security.kubernetes.io/enforce=restricted")
    return k8s_namespace


def test_real_node_is_ready_tainted_and_without_gpus(local_cluster):
    found = json.loads(local_cluster.kubectl("get", "node", node.NODE_NAME, "-o", "json").stdout)
    assert {t["key"]: t["effect"] for t in found["spec"]["taints"]} == {node.NODE_TAINT["key"]: "NoSchedule"}
    assert found["metadata"]["labels"][node.NODE_LABEL] == "true"
    assert "nvidia.com/gpu" not in found["status"]["allocatable"]
    assert found["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://1.6")
    assert found["status"]["nodeInfo"]["kubeletVersion"] == local_cluster.pins.kubernetes
    addresses = {a["type"]: a["address"] for a in found["status"]["addresses"]}
    assert addresses["InternalIP"] == node.BRIDGE_ADDRESS


def test_restricted_pod_runs_in_a_container_without_privileges(local_cluster, restricted_namespace):
    code = """
        import os
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        print("uid", os.getuid(), "CapEff", status["CapEff"].strip(), "NoNewPrivs", status["NoNewPrivs"].strip(),
              "Seccomp", status["Seccomp"].strip())
        routes = open("/proc/net/route").read().splitlines()[1:]
        print("default-route", any(line.split()[1] == "00000000" for line in routes))
    """
    local_cluster.apply(python_pod("whoami", code), "-n", restricted_namespace)
    pod = wait_for_phase(local_cluster, restricted_namespace, "whoami", ("Succeeded", "Failed"))
    assert pod["spec"]["nodeName"] == node.NODE_NAME
    logs = local_cluster.kubectl("logs", "whoami", "-n", restricted_namespace).stdout  # API server -> kubelet
    assert "uid 1000 CapEff 0000000000000000 NoNewPrivs 1 Seccomp 2" in logs, logs
    assert "default-route False" in logs, logs  # nothing a container sends can leave the machine
    assert pod["status"]["phase"] == "Succeeded"


def test_restricted_namespace_refuses_a_privileged_pod(local_cluster, restricted_namespace):
    privileged = json.loads(python_pod("root", "print(1)"))
    privileged["spec"]["securityContext"] = {}
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    refused = local_cluster.kubectl("apply", "-n", restricted_namespace, "-f", "-", input=json.dumps(privileged),
                                    check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr


def test_pods_reach_a_service_by_its_dns_name_and_the_api_server_with_their_token(local_cluster, restricted_namespace):
    ns = restricted_namespace
    server = """
        import http.server
        class Hello(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"hello from the server pod")
        http.server.HTTPServer(("0.0.0.0", 8080), Hello).serve_forever()
    """
    local_cluster.apply(python_pod("server", server, labels={"app": "hello"}, restart="Always"), "-n", ns)
    local_cluster.apply(json.dumps({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "hello"},
        "spec": {"selector": {"app": "hello"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }), "-n", ns)
    wait_for_phase(local_cluster, ns, "server", ("Running",))
    client = f"""
        import json, os, socket, ssl, time, urllib.error, urllib.request
        address = socket.gethostbyname("hello.{ns}.svc.cluster.local")
        for attempt in range(60):
            try:
                print("service", address, urllib.request.urlopen("http://hello", timeout=2).read().decode())
                break
            except OSError:
                time.sleep(0.5)
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        context = ssl.create_default_context(cafile=sa + "/ca.crt")
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        request = urllib.request.Request(f"https://kubernetes.default.svc:{{port}}/api/v1/namespaces/{ns}/secrets",
                                         headers={{"Authorization": "Bearer " + open(sa + "/token").read()}})
        try:
            urllib.request.urlopen(request, context=context, timeout=5)
        except urllib.error.HTTPError as error:
            print("api", host, error.code, json.load(error)["message"])
    """
    local_cluster.apply(python_pod("client", client), "-n", ns)
    wait_for_phase(local_cluster, ns, "client", ("Succeeded", "Failed"))
    logs = local_cluster.kubectl("logs", "client", "-n", ns).stdout
    cluster_ip = local_cluster.kubectl("get", "service", "hello", "-n", ns, "-o", "jsonpath={.spec.clusterIP}").stdout
    assert f"service {cluster_ip} hello from the server pod" in logs, logs
    # The API server answered through the `kubernetes` Service, and knew who was asking: the pod's
    # own ServiceAccount, which may not list secrets.
    assert f'api 10.96.0.1 403 secrets is forbidden: User "system:serviceaccount:{ns}:default"' in logs, logs


def test_a_network_policy_admits_the_pods_it_names_and_refuses_the_rest(local_cluster, restricted_namespace):
    """Enforced by the node's kube-router: a pod of the policy's namespace with the admitted label gets
    through; one without it, and one with it in another namespace, are refused."""
    network_policies.ensure_running(local_cluster)
    ns, other = restricted_namespace, f"{restricted_namespace}-other"
    local_cluster.apply(python_pod("server", "import http.server; http.server.test(port=8080, bind='0.0.0.0')",
                                   labels={"app": "guarded"}, restart="Always"), "-n", ns)
    local_cluster.apply(json.dumps({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "friends-only"},
        "spec": {"podSelector": {"matchLabels": {"app": "guarded"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "friend"}}}]}]},
    }), "-n", ns)
    address = wait_for_phase(local_cluster, ns, "server", ("Running",))["status"]["podIP"]
    # Until the server listens a friend is refused too: it dials until it connects, for 20 s.
    dial = f"""
        import socket, time
        for attempt in range(20):
            try:
                socket.create_connection(("{address}", 8080), timeout=3).close()
                print("open"); break
            except ConnectionRefusedError:
                time.sleep(1)
            except TimeoutError:
                pass
        else:
            print("never open")
    """
    local_cluster.kubectl("create", "namespace", other)
    try:
        for name, namespace, labels in (("friend", ns, {"app": "friend"}), ("stranger", ns, {"app": "stranger"}),
                                        ("outsider", other, {"app": "friend"})):
            local_cluster.apply(python_pod(name, dial, labels=labels), "-n", namespace)
        seen = {}
        for name, namespace in (("friend", ns), ("stranger", ns), ("outsider", other)):
            wait_for_phase(local_cluster, namespace, name, ("Succeeded",), timeout=150)
            seen[name] = local_cluster.kubectl("logs", name, "-n", namespace).stdout.strip()
    finally:
        local_cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
    assert seen == {"friend": "open", "stranger": "never open", "outsider": "never open"}, seen


def test_kubectl_exec_reaches_the_container(local_cluster, restricted_namespace):
    local_cluster.apply(python_pod("sleeper", "import time; time.sleep(600)", restart="Always"), "-n",
                        restricted_namespace)
    wait_for_phase(local_cluster, restricted_namespace, "sleeper", ("Running",))
    out = local_cluster.kubectl("exec", "sleeper", "-n", restricted_namespace, "--", "python3", "-c",
                                "import os; print('pid 1 is', open('/proc/1/cmdline').read().split(chr(0))[0])")
    assert out.stdout.strip() == "pid 1 is python3", out


def test_pods_without_the_toleration_stay_on_fake_nodes(local_cluster, k8s_namespace):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu-only"},
           "spec": {"containers": [{"name": "main", "image": "nothing-pulls-this:never"}]}}
    local_cluster.apply(json.dumps(pod), "-n", k8s_namespace)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        placed = local_cluster.kubectl("get", "pod", "cpu-only", "-n", k8s_namespace, "-o",
                                       "jsonpath={.spec.nodeName}").stdout
        if placed:
            break
        time.sleep(0.5)
    assert placed.startswith("kwok-"), placed


def test_trainer_image_has_ray_on_a_login_shells_path_and_trains_torch_on_cpu(local_cluster, restricted_namespace):
    # KubeRay starts Ray with `/bin/bash -lc -- ... ray start ...`: a login shell, which resets PATH.
    code = ("import torch, ray, transformers, ppo_trainer.cli; m = torch.nn.Linear(8, 1); "
            "m(torch.randn(4, 8)).pow(2).mean().backward(); "
            "import importlib.util; dropped = importlib.util.find_spec('triton') is None; "
            "print('versions', torch.__version__, ray.__version__, torch.cuda.is_available(), m.weight.grad is not None, dropped)")
    pod = json.loads(python_pod("trainer", ""))
    container = pod["spec"]["containers"][0]
    container["image"] = images.TRAINER_CPU_IMAGE
    container["command"] = ["/bin/bash", "-lc", "--", f"id -u && ray --version && python -c \"{code}\" && ppo-train --help"]
    local_cluster.apply(json.dumps(pod), "-n", restricted_namespace)
    done = wait_for_phase(local_cluster, restricted_namespace, "trainer", ("Succeeded", "Failed"), timeout=180)
    logs = local_cluster.kubectl("logs", "trainer", "-n", restricted_namespace).stdout
    assert done["status"]["phase"] == "Succeeded", logs
    lines = logs.splitlines()
    assert lines[0] == "1000" and "2.60.0" in lines[1], logs
    _, torch_version, ray_version, cuda, has_grad, dropped = next(line for line in lines if line.startswith("versions")).split()
    assert ray_version == "2.60.0" and cuda == "False" and has_grad == "True"
    assert dropped == "True", "the CPU image still carries triton (DROP_PACKAGES)"
    assert tuple(int(p) for p in torch_version.split("+")[0].split(".")[:2]) >= (2, 6)
    assert "usage: ppo-train" in logs
