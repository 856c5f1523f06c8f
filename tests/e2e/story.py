"""The README's story on the local cluster, step by step, as a person would live it.

    helm install the chart -> the operator runs with exactly the chart's RBAC -> kubectl apply the
    tiny PPOJob -> gang-scheduled pods on fake GPU nodes -> a real trainer on this CPU reports
    warm-up k/N, training and offload states -> Succeeded -> kubectl delete -> helm uninstall (which
    keeps the PPOJob CRD: crds.keep) -> kubectl delete crd, the documented last step (docs/chart.md).

The local cluster's pods run no containers (KWOK), so the chart's operator Deployment gets a fake
pod; the real operator runs here as a process that authenticates with a token of the chart's
ServiceAccount, so a rule missing from the chart's RBAC fails the story. It starts trainers with
its development launcher (`--launcher local`), each with the per-job least-privilege identity.

Used by tests/e2e/test_readme_story.py and by `make demo` (`python -m story`), which leaves the
cluster up afterwards. Depends on local_cluster and the repo's chart, examples and entry points.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from local_cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ppojob-operator"
EXAMPLE = REPO / "examples" / "tiny-ppojob.yaml"
RELEASE, OPERATOR_NAMESPACE, JOB_NAMESPACE = "ppojob", "ppojob-system", "ppo-demo"
PPOJOB_CRD = "ppojobs.ppojob.io"
OPERATOR_SA = f"{RELEASE}-ppojob-operator"
FINISHED = ("Succeeded", "Failed")
CRD_RESOURCE = "customresourcedefinition.apiextensions.k8s.io"


class StoryError(RuntimeError):
    """A step of the story did not happen as it should; the message says which and what was seen."""


@dataclass
class Story:
    cluster: LocalCluster
    work_dir: Path
    out: callable = print
    job_name: str = "tiny"
    timeline: list[tuple[float, str]] = field(default_factory=list)
    phases_seen: list[str] = field(default_factory=list)
    snapshots: dict[str, str] = field(default_factory=dict)
    _operator: subprocess.Popen | None = None
    _watch: subprocess.Popen | None = None
    _t0: float = field(default_factory=time.monotonic)

    # -- helpers -----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self._t0
        self.timeline.append((elapsed, text))
        self.out(f"[{elapsed:6.1f}s] {text}")

    def kubectl(self, *args: str, check: bool = True) -> str:
        result = self.cluster.kubectl(*args, check=False)
        if check and result.returncode != 0:
            raise StoryError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def job(self) -> dict:
        return json.loads(self.kubectl("get", "ppojob", self.job_name, "-n", JOB_NAMESPACE, "-o", "json"))

    # -- the steps ---------------------------------------------------------------------------
    def adopt_existing_crds(self) -> None:
        """CRDs applied by hand (e.g. by other tests on a shared dev cluster) are handed to the release."""
        for crd in ("ppojobs.ppojob.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
            deleting = self.kubectl("get", "crd", crd, "--ignore-not-found", "-o",
                                    "jsonpath={.metadata.name}/{.metadata.deletionTimestamp}").strip()
            if deleting.endswith("Z"):  # being deleted: wait until it is gone, then helm creates it
                self.kubectl("wait", "--for=delete", f"crd/{crd}", "--timeout=120s")
            elif deleting:
                self.kubectl("label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
                self.kubectl("annotate", "--overwrite", "crd", crd, f"meta.helm.sh/release-name={RELEASE}",
                             f"meta.helm.sh/release-namespace={OPERATOR_NAMESPACE}")

    def install_chart(self) -> None:
        if self.cluster.helm("status", RELEASE, "-n", OPERATOR_NAMESPACE, check=False).returncode == 0:
            self.say(f"an earlier release {RELEASE} is installed: uninstalling it first")
            self.cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", "--timeout", "120s")
        self.adopt_existing_crds()
        phase = self.kubectl("get", "namespace", JOB_NAMESPACE, "--ignore-not-found", "-o",
                             "jsonpath={.status.phase}").strip()
        if phase == "Terminating":  # left by an earlier run: wait until it is gone
            self.kubectl("wait", "--for=delete", f"namespace/{JOB_NAMESPACE}", "--timeout=120s")
        if phase != "Active":
            self.kubectl("create", "namespace", JOB_NAMESPACE)
        self.say(f"helm install {RELEASE} charts/ppojob-operator (watching namespace {JOB_NAMESPACE}, "
                 "trainerLauncher=local, one replica)")
        self.snapshots["helm-install"] = self.cluster.helm(
            "install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
            "--set", f"watchNamespaces={{{JOB_NAMESPACE}}}", "--set", "trainerLauncher=local",
            "--set", "replicas=1", "--wait", "--timeout", "120s",
        ).stdout

    def start_operator(self) -> None:
        token = self.cluster.create_token(OPERATOR_SA, OPERATOR_NAMESPACE, duration="4h")
        kubeconfig = self.work_dir / "operator.kubeconfig"
        server = self.cluster.server
        ca = yaml.safe_load(self.cluster.kubeconfig.read_text())["clusters"][0]["cluster"]
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "operator",
            "clusters": [{"name": "local", "cluster": {**ca, "server": server}}],
            "users": [{"name": OPERATOR_SA, "user": {"token": token}}],
            "contexts": [{"name": "operator", "context": {"cluster": "local", "user": OPERATOR_SA}}],
        }))
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PATH": f"{self.cluster.bin_dir}:{os.environ['PATH']}"}
        with open(self.work_dir / "operator.log", "ab") as log:  # the child keeps its own copy
            self._operator = subprocess.Popen(
                [str(Path(sys.executable).parent / "ppo-operator"), "--launcher", "local", "--namespace", JOB_NAMESPACE,
                 "--peering", OPERATOR_SA, "--priority", "100", "--gang-schedulers", "Coscheduling",
                 "--state-dir", str(self.work_dir / "operator-state"),
                 "--trainer-command", str(Path(sys.executable).parent / "ppo-train"),
                 "--stats-file", str(self.work_dir / "operator-api-calls.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.say(f"operator running here as system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA} "
                 f"(pid {self._operator.pid}, log {self.work_dir / 'operator.log'})")

    def apply_job(self) -> None:
        with open(self.work_dir / "get-ppojobs-w.txt", "wb") as watch_log:
            self._watch = subprocess.Popen(
                [str(self.cluster.bin_dir / "kubectl"), "--kubeconfig", str(self.cluster.kubeconfig),
                 "get", "ppojobs", "-n", JOB_NAMESPACE, "-w"],
                stdout=watch_log, stderr=subprocess.STDOUT,
            )
        self.say("kubectl apply -f examples/tiny-ppojob.yaml")
        self.kubectl("apply", "-n", JOB_NAMESPACE, "-f", str(EXAMPLE))

    def wait_for_children(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            children = self.job().get("status", {}).get("children", {})
            if children.get("podGroup") and children.get("rayCluster"):
                self.say(f"children created: PodGroup {children['podGroup']}, RayCluster {children['rayCluster']}")
                return children
            time.sleep(1)
        raise StoryError(f"no pod group and RayCluster within {timeout}s; operator log: {self.work_dir / 'operator.log'}")

    def wait_for_gang(self, timeout: float = 180) -> list[dict]:
        """All pods of the job Running, bound together on fake GPU nodes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = json.loads(self.kubectl("get", "pods", "-n", JOB_NAMESPACE, "-l",
                                           f"ppojob.io/job-name={self.job_name}", "-o", "json"))["items"]
            if pods and all(p["status"].get("phase") == "Running" for p in pods):
                nodes = sorted({p["spec"]["nodeName"] for p in pods})
                self.say(f"{len(pods)} pods Running together (gang) on {', '.join(nodes)}")
                return pods
            time.sleep(1)
        raise StoryError(f"the job's pods did not all reach Running within {timeout}s")

    def follow(self, timeout: float = 900) -> dict:
        """Poll the job until it finishes, noting each phase and capturing describe along the way."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            status = self.job().get("status", {})
            progress = status.get("progress", {})
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

    def capture(self) -> None:
        self.snapshots["get"] = self.kubectl("get", "ppojobs", "-n", JOB_NAMESPACE)
        self.snapshots["get-wide"] = self.kubectl("get", "ppojobs", "-n", JOB_NAMESPACE, "-o", "wide")
        self.snapshots["describe"] = self.kubectl("describe", "ppojob", self.job_name, "-n", JOB_NAMESPACE)
        self.snapshots["events"] = self.kubectl("get", "events", "-n", JOB_NAMESPACE, "--field-selector",
                                                f"involvedObject.name={self.job_name}",
                                                "--sort-by=.lastTimestamp")
        for name, text in self.snapshots.items():
            (self.work_dir / f"{name}.txt").write_text(text)

    def children_left(self) -> dict[str, list[str]]:
        left = {}
        for kind in ("rayclusters.ray.io", "podgroups.scheduling.x-k8s.io", "pods", "serviceaccounts",
                     "roles.rbac.authorization.k8s.io", "rolebindings.rbac.authorization.k8s.io"):
            names = self.kubectl("get", kind, "-n", JOB_NAMESPACE, "-l", f"ppojob.io/job-name={self.job_name}",
                                 "-o", "name").split()
            if names:
                left[kind] = names
        return left

    def delete_job(self, timeout: float = 120) -> None:
        self.say(f"kubectl delete ppojob {self.job_name}")
        self.kubectl("delete", "ppojob", self.job_name, "-n", JOB_NAMESPACE, "--ignore-not-found",
                     "--timeout", f"{int(timeout)}s")
        deadline = time.monotonic() + timeout
        while (left := self.children_left()) and time.monotonic() < deadline:
            time.sleep(1)
        if left:
            raise StoryError(f"objects of the deleted job are still there: {left}")
        self.say("every child of the job is gone")

    def stop_operator(self) -> None:
        if self._operator and self._operator.poll() is None:
            os.killpg(self._operator.pid, signal.SIGTERM)
            try:
                self._operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self._operator.pid, signal.SIGKILL)
        if self._watch and self._watch.poll() is None:
            self._watch.terminate()

    def uninstall(self) -> dict[str, list[str]]:
        """helm uninstall: what is left of the release besides the PPOJob CRD, which the chart keeps."""
        self.say(f"helm uninstall {RELEASE}")
        self.snapshots["helm-uninstall"] = self.cluster.helm(
            "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--ignore-not-found", "--wait",
            "--timeout", "120s").stdout
        left = {}
        for kind in ("deployments", "serviceaccounts", "roles", "rolebindings", "clusterroles",
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

        Without clean_up the operator keeps running (to serve a later delete as a user's would);
        call `clean_up()` when done.
        """
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.install_chart()
            self.start_operator()
            self.apply_job()
            self.wait_for_children()
            self.wait_for_gang()
            status = self.follow()
            self.capture()
            self.say(f"finished: {status['phase']} after {self.phases_seen}")
        except BaseException:
            self.clean_up()
            raise
        if clean_up:
            self.clean_up()
        return status

    def clean_up(self) -> dict[str, list[str]]:
        """The documented teardown (docs/chart.md): delete the job (the operator still running), stop
        the operator, helm uninstall (the PPOJob CRD is kept), delete the CRD; what was left."""
        left = {}
        try:
            self.delete_job()
        except StoryError as exc:
            left["job"] = [str(exc)]
        finally:
            self.stop_operator()
        left.update(self.uninstall())
        if "kept-crd" not in left:
            left.update(self.delete_crd())
        return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "demo")
    parser.add_argument("--keep", action="store_true", help="keep the release and the job for looking around")
    args = parser.parse_args(argv)
    cluster = LocalCluster.running() or LocalCluster.start(out=sys.stdout)
    story = Story(cluster=cluster, work_dir=args.work_dir)
    try:
        status = story.run(clean_up=not args.keep)
        if args.keep:
            print(f"The operator keeps serving (pid {story._operator.pid}; log {args.work_dir / 'operator.log'}).")
    except StoryError as exc:
        print(f"\nthe story stopped: {exc}", file=sys.stderr)
        return 1
    print("\n$ kubectl get ppojobs -w\n" + (args.work_dir / "get-ppojobs-w.txt").read_text())
    print("$ kubectl describe ppojob tiny\n" + story.snapshots["describe"])
    print(f"Captured output: {args.work_dir}\nThe cluster is still up. Look around with:\n"
          f"  eval $(make -s cluster-env)\n  kubectl get ppojobs,rayclusters,podgroups,pods -A\n"
          f"Stop it with:  make cluster-down")
    return 0 if status["phase"] == "Succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
