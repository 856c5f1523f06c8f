"""The README's story in real pods, step by step, as a person would live it (`make demo`).

    helm install the chart -> the operator runs as the chart's Deployment (two replicas from the
    operator image, peering, in-cluster config, its own ServiceAccount and RBAC) -> a checkpoint
    claim -> kubectl apply the tiny CPU PPOJob in a namespace that enforces the `restricted` Pod
    Security Standard -> PodGroup and RayCluster -> KubeRay starts the head and the worker from the
    CPU trainer image on the real node -> a pod of another namespace reaches none of the head's
    ports (the job's NetworkPolicy, enforced on the node) -> the operator submits the trainer
    through Ray's job API (with the job's Ray token) -> the trainer reports with its projected ServiceAccount token ->
    kubectl get -w shows warm-up k/N and offload states, kubectl logs of the head the trainer's step
    lines -> checkpoints on the claim -> Succeeded -> kubectl delete leaves nothing -> helm uninstall
    (the PPOJob CRD is kept: crds.keep) -> kubectl delete crd, the documented last step.

One entry point: `make demo` runs `main()`, and the e2e test runs `make demo` itself and reads what
it wrote (`story.json` and the captured outputs in the work dir). Depends on local_cluster (the
cluster with its real node, the images), the repo's chart and examples.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from local_cluster import LocalCluster, images, network_policies, node

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ppojob-operator"
EXAMPLE = REPO / "examples" / "tiny-cpu-ppojob.yaml"
RELEASE, OPERATOR_NAMESPACE, JOB_NAMESPACE = "ppojob", "ppojob-system", "ppo-demo"
OUTSIDER_NAMESPACE = "ppo-demo-outsider"
"""Another tenant's namespace, from which a pod dials the head."""
PPOJOB_CRD = "ppojobs.ppojob.io"
FINISHED = ("Succeeded", "Failed")
CRD_RESOURCE = "customresourcedefinition.apiextensions.k8s.io"
REAL_NODE_TOLERATION = {"key": node.NODE_TAINT["key"], "operator": "Equal", "value": node.NODE_TAINT["value"],
                        "effect": node.NODE_TAINT["effect"]}
STEP_LINE = re.compile(r'"step":\s*\d+')  # the trainer's JSON step lines


class StoryError(RuntimeError):
    """A step of the story did not happen as it should; the message says which and what was seen."""


def chart_values(*, job_namespace: str) -> dict:
    """The chart's values for the local cluster: the operator image from `make images`, both replicas
    on the real node, the production launcher, and a Ray head small enough for a 2-core node."""
    repository, tag = images.OPERATOR_IMAGE.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "replicas": 2,
        "watchNamespaces": [job_namespace],
        "trainerLauncher": "ray-jobs",
        "nodeSelector": {node.NODE_LABEL: "true"},
        "tolerations": [REAL_NODE_TOLERATION],
        "resources": {"requests": {"cpu": "50m", "memory": "160Mi"}, "limits": {"cpu": "500m", "memory": "384Mi"}},
        "rayHead": {"cpu": "700m", "memory": "2Gi"},
    }


def _proc_net_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: hex, each 32-bit word in the host's (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    return getattr(address, "ipv4_mapped", None) or address


def checkpoint_volume(*, name: str, namespace: str, claim: str, path: Path) -> str:
    """A local PersistentVolume on the real node, bound to the job's claim (static provisioning: no
    provisioner runs here), as JSON documents."""
    pv = {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "claimRef": {"namespace": namespace, "name": claim},
            "local": {"path": str(path)},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node.NODE_NAME]}]}]}},
        },
    }
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": namespace},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": name,
                 "resources": {"requests": {"storage": "1Gi"}}},
    }
    return json.dumps(pv) + "\n---\n" + json.dumps(pvc) + "\n"


def example_job(name: str, *, claim: str, steps: int | None = None) -> dict:
    """The example PPOJob under another name, with its own checkpoint claim (and `steps` rollouts)."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["checkpoint"]["volumeClaim"] = claim
    if steps is not None:
        manifest["spec"]["ppo"]["numRollouts"] = steps
    return manifest


@dataclass
class Story:
    cluster: LocalCluster
    work_dir: Path
    out: object = sys.stdout
    job_name: str = "tiny"
    timeline: list[tuple[float, str]] = field(default_factory=list)
    phases_seen: list[str] = field(default_factory=list)
    snapshots: dict[str, str] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    head_ports: dict = field(default_factory=dict)
    """What a pod in another namespace got dialling the head's ports (probe_head_from_another_namespace)."""
    _watch: subprocess.Popen | None = None
    _t0: float = field(default_factory=time.monotonic)
    _applied_at: float = 0.0

    # -- helpers -----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self._t0
        self.timeline.append((round(elapsed, 1), text))
        print(f"[{elapsed:6.1f}s] {text}", file=self.out, flush=True)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        result = self.cluster.kubectl(*args, check=False, timeout=timeout)
        if check and result.returncode != 0:
            raise StoryError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def job(self) -> dict:
        return json.loads(self.kubectl("get", "ppojob", self.job_name, "-n", JOB_NAMESPACE, "-o", "json"))

    def pods(self, namespace: str, selector: str) -> list[dict]:
        return json.loads(self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json"))["items"]

    @property
    def claim(self) -> str:
        return f"{self.job_name}-checkpoints"

    @property
    def volume_path(self) -> Path:
        return self.cluster.node_paths.root / "volumes" / f"{JOB_NAMESPACE}-{self.claim}"

    # -- the steps ---------------------------------------------------------------------------
    def check_cluster(self) -> None:
        """The real node is Ready, holds the images (`make images`) and enforces NetworkPolicies."""
        ready = self.kubectl("get", "node", node.NODE_NAME, "--ignore-not-found", "-o",
                             "jsonpath={.status.conditions[?(@.type=='Ready')].status}").strip()
        if ready != "True":
            raise StoryError(f"the real node {node.NODE_NAME} is not Ready ({ready or 'absent'}); "
                             f"see {self.cluster.log_dir / 'kubelet.log'}")
        present = self.cluster.crictl("images", "-o", "json")
        tags = {t for i in json.loads(present.stdout or "{}").get("images", []) for t in i.get("repoTags", [])}
        missing = [name for name in (images.OPERATOR_IMAGE, images.TRAINER_CPU_IMAGE) if name not in tags]
        if missing:
            raise StoryError(f"the real node's runtime lacks {', '.join(missing)}: run `make images`")
        network_policies.ensure_running(self.cluster)  # a cluster started before the enforcer joined it
        self.say(f"{node.NODE_NAME} enforces NetworkPolicies ({network_policies.NAME}'s policy controller)")

    def adopt_existing_crds(self) -> None:
        """CRDs applied by hand (e.g. by other tests on a shared dev cluster) are handed to the release."""
        for crd in (PPOJOB_CRD, "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
            deleting = self.kubectl("get", "crd", crd, "--ignore-not-found", "-o",
                                    "jsonpath={.metadata.name}/{.metadata.deletionTimestamp}").strip()
            if deleting.endswith("Z"):  # being deleted: wait until it is gone, then helm creates it
                self.kubectl("wait", "--for=delete", f"crd/{crd}", "--timeout=120s")
            elif deleting:
                self.kubectl("label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
                self.kubectl("annotate", "--overwrite", "crd", crd, f"meta.helm.sh/release-name={RELEASE}",
                             f"meta.helm.sh/release-namespace={OPERATOR_NAMESPACE}")

    def create_job_namespace(self) -> None:
        phase = self.kubectl("get", "namespace", JOB_NAMESPACE, "--ignore-not-found", "-o",
                             "jsonpath={.status.phase}").strip()
        if phase == "Terminating":  # left by an earlier run: wait until it is gone
            self.kubectl("wait", "--for=delete", f"namespace/{JOB_NAMESPACE}", "--timeout=180s", timeout=200)
        if phase != "Active":
            self.kubectl("create", "namespace", JOB_NAMESPACE)
        self.kubectl("label", "--overwrite", "namespace", JOB_NAMESPACE,
                     "pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")
        self.say(f"namespace {JOB_NAMESPACE} enforces the restricted Pod Security Standard")

    def install_chart(self) -> None:
        if self.cluster.helm("status", RELEASE, "-n", OPERATOR_NAMESPACE, check=False).returncode == 0:
            self.say(f"an earlier release {RELEASE} is installed: uninstalling it first")
            self.cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", "--timeout", "120s")
        self.adopt_existing_crds()
        values = self.work_dir / "values.yaml"
        values.write_text(yaml.safe_dump(chart_values(job_namespace=JOB_NAMESPACE)))
        self.say(f"helm install {RELEASE} charts/ppojob-operator -f {values.name} (image {images.OPERATOR_IMAGE}, "
                 "two replicas on the real node, trainerLauncher=ray-jobs)")
        self.snapshots["helm-install"] = self.cluster.helm(
            "install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
            "-f", str(values), "--wait", "--timeout", "180s", timeout=240,
        ).stdout

    def wait_for_operator(self, timeout: float = 120) -> list[dict]:
        """Both replicas Running and Ready in their containers, one of them serving (kopf peering)."""
        deadline = time.monotonic() + timeout
        selector = f"app.kubernetes.io/instance={RELEASE}"
        while time.monotonic() < deadline:
            pods = self.pods(OPERATOR_NAMESPACE, selector)
            ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                            for c in p["status"].get("conditions", []))]
            peering = self.kubectl("get", "kopfpeerings.kopf.dev", "-n", JOB_NAMESPACE, "-o", "json", check=False)
            peers = {key for item in json.loads(peering or '{"items": []}')["items"]
                     for key in (item.get("status") or {})}
            names = [p["metadata"]["name"] for p in ready]
            if len(ready) == 2 and all(any(name in peer for peer in peers) for name in names):
                self.say(f"operator: 2 replicas Running on {ready[0]['spec']['nodeName']} "
                         f"({', '.join(names)}), both peers in kopf's peering")
                return ready
            time.sleep(1)
        raise StoryError(f"the operator's two replicas did not become Ready and peer within {timeout}s")

    def create_checkpoint_claim(self) -> None:
        self.volume_path.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.volume_path, 1000, 1000)  # the trainer image's user
        self.cluster.apply(checkpoint_volume(name=f"{JOB_NAMESPACE}-{self.claim}", namespace=JOB_NAMESPACE,
                                             claim=self.claim, path=self.volume_path))
        self.say(f"PersistentVolumeClaim {self.claim}: a local volume on {node.NODE_NAME} ({self.volume_path})")

    def apply_job(self, manifest: dict | None = None) -> None:
        """kubectl apply the example (or `manifest`, a variant of it), watching with kubectl get -w."""
        with open(self.work_dir / "get-ppojobs-w.txt", "wb") as watch_log:
            self._watch = subprocess.Popen(
                [str(self.cluster.bin_dir / "kubectl"), "--kubeconfig", str(self.cluster.kubeconfig),
                 "get", "ppojobs", "-n", JOB_NAMESPACE, "-w"],
                stdout=watch_log, stderr=subprocess.STDOUT,
            )
        self._applied_at = time.monotonic()
        if manifest is None:
            self.say(f"kubectl apply -f examples/{EXAMPLE.name}")
            self.kubectl("apply", "-n", JOB_NAMESPACE, "-f", str(EXAMPLE))
        else:
            self.say(f"kubectl apply PPOJob {manifest['metadata']['name']}")
            self.cluster.apply(json.dumps(manifest), "-n", JOB_NAMESPACE)

    def wait_for_children(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            children = self.job().get("status", {}).get("children", {})
            if children.get("podGroup") and children.get("rayCluster"):
                self.say(f"children created: PodGroup {children['podGroup']}, RayCluster {children['rayCluster']}")
                return children
            time.sleep(1)
        raise StoryError(f"no pod group and RayCluster within {timeout}s: {self.operator_logs()[-2000:]}")

    def wait_for_pods(self, timeout: float = 300) -> list[dict]:
        """Head and worker containers Running (Ready) on the real node, placed together by the gang scheduler."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = self.pods(JOB_NAMESPACE, f"ppojob.io/job-name={self.job_name}")
            if len(pods) >= 2 and all(
                p["status"].get("phase") == "Running"
                and all(c.get("ready") for c in p["status"].get("containerStatuses", []))
                for p in pods
            ):
                self.figures["apply_to_pods_running_s"] = round(time.monotonic() - self._applied_at, 1)
                nodes = sorted({p["spec"]["nodeName"] for p in pods})
                self.say(f"{len(pods)} pods Running in containers on {', '.join(nodes)} "
                         f"({self.figures['apply_to_pods_running_s']}s after apply)")
                return pods
            time.sleep(1)
        states = {p["metadata"]["name"]: p["status"].get("containerStatuses") for p in pods}
        raise StoryError(f"the job's pods did not all run within {timeout}s: {states}")

    def head_listening_ports(self) -> list[int]:
        """The TCP ports the head's pod listens on at an address other pods could dial (not loopback),
        read from its container's network namespace on the node."""
        (head,) = self.pods(JOB_NAMESPACE, f"ppojob.io/job-name={self.job_name},ppojob.io/role=head")
        sandbox = self.cluster.crictl("pods", "--name", head["metadata"]["name"], "--namespace", JOB_NAMESPACE,
                                      "--state", "ready", "-q").stdout.split()[0]
        (container,) = json.loads(self.cluster.crictl("ps", "--pod", sandbox, "-o", "json").stdout)["containers"]
        pid = json.loads(self.cluster.crictl("inspect", container["id"]).stdout)["info"]["pid"]
        ports = set()
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port = local.split(":")
                if state == "0A" and not _proc_net_address(address).is_loopback:  # 0A: LISTEN
                    ports.add(int(port, 16))
        return sorted(ports)

    def probe_head_from_another_namespace(self, timeout: float = 120) -> dict:
        """From a pod in another namespace, a TCP connection to each port the head listens on: the job's
        NetworkPolicy (enforced on the real node) lets none through. The API server, which the policy
        does not guard, answers the same pod: its network works. Returns each head port's outcome
        ("open", "refused", "timed out" or the error) under "head", the API server's under "api server"."""
        (head,) = self.pods(JOB_NAMESPACE, f"ppojob.io/job-name={self.job_name},ppojob.io/role=head")
        targets = [[head["status"]["podIP"], port] for port in self.head_listening_ports()]
        targets.append([node.BRIDGE_ADDRESS, node.API_SERVER_PORT])
        code = ("import concurrent.futures, json, socket, sys\n"
                "def dial(target):\n"
                "    try:\n"
                "        socket.create_connection(tuple(target), timeout=5).close()\n"
                "        return 'open'\n"
                "    except ConnectionRefusedError:\n"
                "        return 'refused'\n"
                "    except TimeoutError:\n"
                "        return 'timed out'\n"
                "    except OSError as error:\n"
                "        return error.strerror\n"
                "targets = json.loads(sys.argv[1])\n"
                "with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:\n"
                "    print(json.dumps(list(zip(map(tuple, targets), pool.map(dial, targets)))))\n")
        probe = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{self.job_name}-outsider-probe"},
            "spec": {
                "restartPolicy": "Never", "automountServiceAccountToken": False,
                "nodeSelector": {node.NODE_LABEL: "true"}, "tolerations": [REAL_NODE_TOLERATION],
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{"name": "probe", "image": images.OPERATOR_IMAGE, "imagePullPolicy": "IfNotPresent",
                                "command": ["python3", "-c", code, json.dumps(targets)],
                                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
            },
        }
        name = probe["metadata"]["name"]
        self.kubectl("delete", "namespace", OUTSIDER_NAMESPACE, "--ignore-not-found", "--timeout=180s", timeout=200)
        self.kubectl("create", "namespace", OUTSIDER_NAMESPACE)
        try:
            self.cluster.apply(json.dumps(probe), "-n", OUTSIDER_NAMESPACE)
            self.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", f"pod/{name}", "-n", OUTSIDER_NAMESPACE,
                         f"--timeout={int(timeout)}s", timeout=timeout + 30)
            dialled = json.loads(self.kubectl("logs", name, "-n", OUTSIDER_NAMESPACE))
        finally:
            self.kubectl("delete", "namespace", OUTSIDER_NAMESPACE, "--wait=false", check=False)
        head = {port: outcome for (_, port), outcome in dialled[:-1]}
        by_outcome: dict[str, list[int]] = {}
        for port, outcome in head.items():
            by_outcome.setdefault(outcome, []).append(port)
        api_server = dialled[-1][1]
        self.say(f"from a pod in namespace {OUTSIDER_NAMESPACE}, the head's {len(head)} listening ports: "
                 + "; ".join(f"{outcome} {ports}" for outcome, ports in by_outcome.items())
                 + f"; the API server: {api_server}")
        return {"head": head, "api server": api_server}

    def follow(self, timeout: float = 900) -> dict:
        """Poll the job until it finishes, noting each phase and capturing describe along the way."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            status = self.job().get("status", {})
            progress = status.get("progress", {})
            if progress.get("step", 0) >= 1 and "apply_to_first_step_s" not in self.figures:
                self.figures["apply_to_first_step_s"] = round(time.monotonic() - self._applied_at, 1)
            view = (status.get("phase"), progress.get("steps"), progress.get("warmup"), progress.get("stage"),
                    progress.get("offload"))
            if view != last:
                last = view
                self.say("phase={} steps={} warmup={} stage={} offload={}".format(*view))
                phase = status.get("phase")
                if phase and (not self.phases_seen or self.phases_seen[-1] != phase):
                    self.phases_seen.append(phase)
                    self.snapshots[f"describe-{phase}"] = self.kubectl("describe", "ppojob", self.job_name,
                                                                       "-n", JOB_NAMESPACE)
            if status.get("phase") in FINISHED:
                return status
            time.sleep(0.5)
        raise StoryError(f"the job did not finish within {timeout}s; phases seen: {self.phases_seen}")

    def head_logs(self) -> str:
        pods = self.pods(JOB_NAMESPACE, f"ppojob.io/job-name={self.job_name},ppojob.io/role=head")
        if not pods:
            return ""
        return self.kubectl("logs", "-n", JOB_NAMESPACE, pods[0]["metadata"]["name"], "-c", "ray-head", check=False)

    def operator_logs(self) -> str:
        return self.kubectl("logs", "-n", OPERATOR_NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}",
                            "--tail=200", "--prefix", check=False)

    def capture(self) -> None:
        self.snapshots["get"] = self.kubectl("get", "ppojobs", "-n", JOB_NAMESPACE)
        self.snapshots["get-wide"] = self.kubectl("get", "ppojobs", "-n", JOB_NAMESPACE, "-o", "wide")
        self.snapshots["describe"] = self.kubectl("describe", "ppojob", self.job_name, "-n", JOB_NAMESPACE)
        self.snapshots["events"] = self.kubectl("get", "events", "-n", JOB_NAMESPACE, "--field-selector",
                                                f"involvedObject.name={self.job_name}", "--sort-by=.lastTimestamp")
        self.snapshots["get-pods"] = self.kubectl("get", "pods", "-n", JOB_NAMESPACE, "-o", "wide")
        self.snapshots["logs-head"] = self.head_logs()
        self.snapshots["logs-operator"] = self.operator_logs()
        steps = STEP_LINE.findall(self.snapshots["logs-head"])
        self.say(f"kubectl logs of the head: {len(steps)} step lines of the trainer")
        checkpoints = sorted(p.name for p in self.volume_path.glob("step-*"))
        self.snapshots["checkpoints"] = "\n".join(checkpoints)
        self.say(f"checkpoints on the claim: {', '.join(checkpoints) or 'none'}")
        for name, text in self.snapshots.items():
            (self.work_dir / f"{name}.txt").write_text(text)

    def children_left(self) -> dict[str, list[str]]:
        left = {}
        for kind in ("rayclusters.ray.io", "podgroups.scheduling.x-k8s.io", "pods", "services", "serviceaccounts",
                     "roles.rbac.authorization.k8s.io", "rolebindings.rbac.authorization.k8s.io", "secrets",
                     "configmaps", "networkpolicies.networking.k8s.io"):
            names = self.kubectl("get", kind, "-n", JOB_NAMESPACE, "-l", f"ppojob.io/job-name={self.job_name}",
                                 "-o", "name").split()
            if names:
                left[kind] = names
        return left

    def delete_job(self, timeout: float = 180) -> None:
        self.say(f"kubectl delete ppojob {self.job_name}")
        self.kubectl("delete", "ppojob", self.job_name, "-n", JOB_NAMESPACE, "--ignore-not-found",
                     "--timeout", f"{int(timeout)}s", timeout=timeout + 30)
        deadline = time.monotonic() + timeout
        while (left := self.children_left()) and time.monotonic() < deadline:
            time.sleep(1)
        if left:
            raise StoryError(f"objects of the deleted job are still there: {left}")
        self.say("every child of the job is gone, its containers too")

    def delete_checkpoint_claim(self) -> None:
        self.kubectl("delete", "pvc", self.claim, "-n", JOB_NAMESPACE, "--ignore-not-found", "--wait=false", check=False)
        self.kubectl("delete", "pv", f"{JOB_NAMESPACE}-{self.claim}", "--ignore-not-found", "--wait=false", check=False)
        shutil.rmtree(self.volume_path, ignore_errors=True)

    def uninstall(self) -> dict[str, list[str]]:
        """helm uninstall: what is left of the release besides the PPOJob CRD, which the chart keeps."""
        self.say(f"helm uninstall {RELEASE}")
        self.snapshots["helm-uninstall"] = self.cluster.helm(
            "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--ignore-not-found", "--wait",
            "--timeout", "120s").stdout
        # --wait waits for the Deployment; its pods stop afterwards (the operator's graceful shutdown).
        self.kubectl("wait", "--for=delete", "pods", "-n", OPERATOR_NAMESPACE, "-l",
                     f"app.kubernetes.io/instance={RELEASE}", "--timeout=90s", check=False, timeout=120)
        left = {}
        for kind in ("deployments", "pods", "serviceaccounts", "roles", "rolebindings", "clusterroles",
                     "clusterrolebindings", "crds", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
            names = self.kubectl("get", kind, "-A", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name",
                                 check=False).split()
            if names:
                left[kind] = names
        crds = self.kubectl("get", "crds", "-o", "name").split()
        left_crds = [c for c in crds if c.endswith(("ppojob.io", "kopf.dev")) and c != f"{CRD_RESOURCE}/{PPOJOB_CRD}"]
        if left_crds:
            left["crds"] = left_crds
        kept = self.kubectl("get", "crd", PPOJOB_CRD, "--ignore-not-found", "-o",
                            "jsonpath={.metadata.name}/{.metadata.deletionTimestamp}").strip()
        if kept != f"{PPOJOB_CRD}/":
            left["kept-crd"] = [f"{PPOJOB_CRD} should be kept, not deleted: found {kept or 'nothing'}"]
        self.say("helm uninstall kept the PPOJob CRD and left nothing else behind" if not left
                 else f"left behind: {left}")
        self.kubectl("delete", "namespace", JOB_NAMESPACE, "--wait=false", check=False)
        return left

    def delete_crd(self) -> dict[str, list[str]]:
        """The documented last step: kubectl delete crd, once no PPOJob is left anywhere (deleting the
        CRD would delete them); what is left."""
        jobs = self.kubectl("get", "ppojobs", "-A", "-o", "name", check=False).split()
        if jobs:
            self.say(f"not deleting the CRD: PPOJobs are left in the cluster: {jobs[:5]}")
            return {"ppojobs": jobs}
        self.say(f"kubectl delete crd {PPOJOB_CRD}")
        self.kubectl("delete", "crd", PPOJOB_CRD, "--ignore-not-found", "--timeout", "60s")
        if self.kubectl("get", "crd", PPOJOB_CRD, "--ignore-not-found", "-o", "name").strip():
            return {"crds": [PPOJOB_CRD]}
        self.say("the PPOJob CRD is gone: nothing of the chart is left")
        return {}

    def run(self, *, clean_up: bool = True) -> dict:
        """Install, run the job to its end, capture; with clean_up, delete the job and uninstall.
        Without it the release and the job stay for looking around (`clean_up()` later)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.check_cluster()
            self.create_job_namespace()
            self.install_chart()
            self.wait_for_operator()
            self.create_checkpoint_claim()
            self.apply_job()
            self.wait_for_children()
            self.wait_for_pods()
            self.head_ports = self.probe_head_from_another_namespace()
            status = self.follow()
            self.capture()
            self.say(f"finished: {status['phase']} after {self.phases_seen}")
        except BaseException:
            self.snapshots.setdefault("logs-operator", self.operator_logs())
            (self.work_dir / "logs-operator.txt").write_text(self.snapshots["logs-operator"])
            self.clean_up()
            raise
        if clean_up:
            self.clean_up()
        return status

    def clean_up(self) -> dict[str, list[str]]:
        """The documented teardown (docs/chart.md): delete the job (the operator still running), helm
        uninstall (the PPOJob CRD is kept), delete the CRD; what was left."""
        left = {}
        try:
            self.delete_job()
        except StoryError as exc:
            left["job"] = [str(exc)]
        finally:
            if self._watch and self._watch.poll() is None:
                self._watch.terminate()
            self.delete_checkpoint_claim()
        left.update(self.uninstall())
        if "kept-crd" not in left:
            left.update(self.delete_crd())
        return left

    def record(self, status: dict | None, left: dict | None, error: str | None) -> None:
        """story.json: what the e2e test reads back after `make demo`."""
        (self.work_dir / "story.json").write_text(json.dumps({
            "status": status, "left": left, "error": error, "phases_seen": self.phases_seen,
            "timeline": self.timeline, "head_ports": self.head_ports, "figures": {**self.figures, "wall_s": round(time.monotonic() - self._t0, 1)},
        }, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "demo")
    parser.add_argument("--keep", action="store_true", help="keep the release and the job for looking around")
    args = parser.parse_args(argv)
    cluster = LocalCluster.running() or LocalCluster.start(out=sys.stdout)
    images.load_images(cluster.containerd_address)  # built by `make images`; imported once per build
    story = Story(cluster=cluster, work_dir=args.work_dir)
    status = left = None
    try:
        status = story.run(clean_up=False)
        if not args.keep:
            left = story.clean_up()
    except StoryError as exc:
        story.record(status, left, str(exc))
        print(f"\nthe story stopped: {exc}", file=sys.stderr)
        return 1
    story.record(status, left, None)
    print("\n$ kubectl get ppojobs -w\n" + (args.work_dir / "get-ppojobs-w.txt").read_text())
    print("$ kubectl describe ppojob tiny\n" + story.snapshots["describe"])
    print(f"Captured output: {args.work_dir}\nThe cluster is still up. Look around with:\n"
          f"  eval $(make -s cluster-env)\n  kubectl get ppojobs,rayclusters,podgroups,pods -A\n"
          f"Stop it with:  make cluster-down")
    return 0 if status["phase"] == "Succeeded" and not left else 1


if __name__ == "__main__":
    sys.exit(main())
