"""`helm uninstall` of the chart on the local cluster with a PPOJob and no operator running.

By default (crds.keep=true) the uninstall returns at once and keeps the PPOJob CRD and the job.
With crds.keep=false and a PPOJob of an earlier version, which still carries the finalizer those
versions put on, the CRD stays Terminating until the finalizer is removed with the command
docs/chart.md gives, which this test reads from that page and runs.

The cluster is shared: each test adopts the chart's CRDs if they are there, removes its finalizers,
and deletes the PPOJob CRD only when no other PPOJob is left (re-applying crds/ if it was there).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "ppojob-operator"
EXAMPLE = REPO / "examples" / "tiny-ppojob.yaml"
DOC = REPO / "docs" / "chart.md"
CRD = "ppojobs.ppojob.io"
CHART_CRDS = (CRD, "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")
FINALIZER = "ppojob.io/operator"
UNFINALIZE = '{"metadata":{"finalizers":null}}'


def get(cluster, *args: str) -> dict | None:
    found = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def adopt_crds(cluster, release: str, namespace: str) -> bool:
    """Hand the chart's CRDs already on the cluster to this release; whether the PPOJob CRD was there."""
    there = False
    for name in CHART_CRDS:
        crd = get(cluster, "crd", name)
        if crd is None:
            continue
        if crd["metadata"].get("deletionTimestamp"):
            cluster.kubectl("wait", "--for=delete", f"crd/{name}", "--timeout=120s")
            continue
        there |= name == CRD
        cluster.kubectl("label", "--overwrite", "crd", name, "app.kubernetes.io/managed-by=Helm")
        cluster.kubectl("annotate", "--overwrite", "crd", name, f"meta.helm.sh/release-name={release}",
                        f"meta.helm.sh/release-namespace={namespace}")
    return there


def install(cluster, release: str, namespace: str, *values: str) -> str:
    sets = [arg for value in values for arg in ("--set", value)]
    return cluster.helm("install", release, str(CHART), "-n", namespace, "--set", f"watchNamespaces={{{namespace}}}",
                        "--set", "replicas=1", *sets, "--wait", "--timeout", "120s").stdout


def create_job(cluster, namespace: str, *, finalizers: tuple[str, ...] = ()) -> str:
    """The tiny example (with `finalizers`: as an earlier version of the operator left it)."""
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"].update(namespace=namespace, finalizers=list(finalizers))
    cluster.wait_established(CRD)
    cluster.apply(json.dumps(job))
    return job["metadata"]["name"]


def other_ppojobs(cluster, namespace: str) -> list[str]:
    jobs = get(cluster, "ppojobs", "-A")
    return [f"{j['metadata']['namespace']}/{j['metadata']['name']}" for j in (jobs or {"items": []})["items"]
            if j["metadata"]["namespace"] != namespace]


def restore_crd(cluster, was_there: bool) -> None:
    """Leave the PPOJob CRD as it was found: there (crds/'s) or, when no PPOJob is left, gone."""
    if was_there:
        if get(cluster, "crd", CRD) is None:
            cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / f"{CRD}.yaml"))
        return
    if get(cluster, "crd", CRD) is not None and not get(cluster, "ppojobs", "-A")["items"]:
        cluster.kubectl("delete", "crd", CRD, "--timeout=60s")


def unfinalize(cluster, namespace: str, name: str) -> None:
    cluster.kubectl("patch", "ppojob", name, "-n", namespace, "--type=merge", "-p", UNFINALIZE, check=False)
    cluster.kubectl("delete", "ppojob", name, "-n", namespace, "--ignore-not-found", "--timeout=30s", check=False)


def documented_unstick_command() -> str:
    """The command docs/chart.md gives to remove the finalizer from every PPOJob in the cluster."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.DOTALL)
    (command,) = [b for b in blocks if b.startswith("kubectl get ppojobs -A")]
    assert UNFINALIZE in command and "kubectl patch ppojob" in command, command
    return command


def test_uninstall_keeps_the_crd_and_the_jobs_and_returns_at_once(local_cluster, k8s_namespace):
    cluster, ns = local_cluster, k8s_namespace
    release = "chart-keep"
    crd_was_there = adopt_crds(cluster, release, ns)
    name = None
    try:
        notes = install(cluster, release, ns)
        assert "kubectl delete crd ppojobs.ppojob.io" in notes, notes
        crd = get(cluster, "crd", CRD)
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        name = create_job(cluster, ns)  # no operator runs

        started = time.monotonic()
        result = cluster.helm("uninstall", release, "-n", ns, "--wait", "--timeout", "120s")
        took = time.monotonic() - started
        assert took < 30, f"helm uninstall --wait took {took:.0f}s: waiting on a deleted CRD?"
        assert "kept due to the resource policy" in result.stdout and CRD in result.stdout, result.stdout

        crd = get(cluster, "crd", CRD)
        assert crd is not None and not crd["metadata"].get("deletionTimestamp"), "the CRD must be kept, not Terminating"
        assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
        job = get(cluster, "ppojob", name, "-n", ns)
        assert job is not None and not job["metadata"].get("deletionTimestamp"), "the PPOJob must be kept"
        assert cluster.helm("status", release, "-n", ns, check=False).returncode != 0, "the release is gone"
        left = cluster.kubectl("get", "deployments,serviceaccounts,clusterroles,clusterrolebindings", "-A", "-l",
                               f"app.kubernetes.io/instance={release}", "-o", "name").stdout.split()
        assert left == [], left
        for name_ in CHART_CRDS[1:]:  # kopf's peering CRDs go with the release
            assert get(cluster, "crd", name_) is None or get(cluster, "crd", name_)["metadata"].get("deletionTimestamp")
        # A new install of the same release takes the kept CRD back.
        install(cluster, release, ns)
        assert get(cluster, "ppojob", name, "-n", ns) is not None
        cluster.helm("uninstall", release, "-n", ns, "--wait", "--timeout", "120s")
    finally:
        if name:
            unfinalize(cluster, ns, name)
        cluster.helm("uninstall", release, "-n", ns, "--ignore-not-found", "--timeout", "120s", check=False)
        restore_crd(cluster, crd_was_there)
    assert get(cluster, "crd", CRD) is None or crd_was_there


def test_crds_keep_false_deletes_the_crd_which_waits_for_the_documented_finalizer_removal(
    local_cluster, k8s_namespace, tmp_path
):
    cluster, ns = local_cluster, k8s_namespace
    release = "chart-nokeep"
    others = other_ppojobs(cluster, ns)
    if others:
        pytest.skip(f"deleting the PPOJob CRD would delete other tests' PPOJobs: {others[:5]}")
    command = documented_unstick_command()
    crd_was_there = adopt_crds(cluster, release, ns)
    name = None
    try:
        notes = install(cluster, release, ns, "crds.keep=false")
        assert "WARNING crds.keep=false" in notes, notes
        # helm uninstall decides what to keep from the release's manifest (a CRD adopted from a kept
        # one may still carry the annotation: helm's install patch does not remove it).
        manifest = cluster.helm("get", "manifest", release, "-n", ns).stdout
        assert f"name: {CRD}" in manifest and "helm.sh/resource-policy" not in manifest
        name = create_job(cluster, ns, finalizers=(FINALIZER,))  # no operator runs to take it off

        result = cluster.helm("uninstall", release, "-n", ns, "--wait", "--timeout", "5s", check=False)
        assert result.returncode != 0 and "context deadline exceeded" in result.stderr, (result.stdout, result.stderr)
        assert cluster.helm("status", release, "-n", ns, check=False).returncode != 0, "the release is gone anyway"
        time.sleep(2)
        crd = get(cluster, "crd", CRD)
        assert crd is not None and crd["metadata"].get("deletionTimestamp"), "the CRD should be stuck Terminating"
        assert get(cluster, "ppojob", name, "-n", ns)["metadata"]["deletionTimestamp"]

        script = tmp_path / "unstick.sh"
        script.write_text("set -euo pipefail\n" + command)
        run = subprocess.run(["bash", str(script)], check=False, env=cluster.env(), capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        assert f"ppojob.ppojob.io/{name} patched" in run.stdout, run.stdout
        cluster.kubectl("wait", "--for=delete", f"crd/{CRD}", "--timeout=60s")
        name = None
    finally:
        if name:
            unfinalize(cluster, ns, name)
        cluster.helm("uninstall", release, "-n", ns, "--ignore-not-found", "--timeout", "120s", check=False)
        if get(cluster, "crd", CRD) is not None:
            cluster.kubectl("wait", "--for=delete", f"crd/{CRD}", "--timeout=60s", check=False)
        restore_crd(cluster, crd_was_there)
