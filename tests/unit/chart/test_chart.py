"""The Helm chart: lint, the rendered objects, RBAC, pod security, and values validation."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from chart_paths import CHART, REPO

from ppo_operator.builders.common import BuildOptions
from ppo_operator.builders.network_policy import build_network_policy
from ppo_operator.builders.pod_group import build_pod_group
from ppo_operator.builders.ray_token import build_ray_token_secret
from ppo_operator.builders.raycluster import build_raycluster
from ppo_operator.builders.rbac import build_progress_configmap, build_role, build_role_binding, build_service_account
from ppo_operator.gang import backend_for
from ppo_operator.job import Job
from ppo_operator.kube import PLURALS
from ppojob_api.vocabulary import GangScheduler


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def test_chart_crd_is_the_crds_folder_copy():
    assert (CHART / "files" / "crds" / "ppojobs.ppojob.io.yaml").read_text() == (
        REPO / "crds" / "ppojobs.ppojob.io.yaml"
    ).read_text(), "charts/ppojob-operator/files/crds drifted from crds/: copy crds/ppojobs.ppojob.io.yaml over it"


def test_helm_lint_is_clean(helm):
    result = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_default_render_has_every_object_labelled(render):
    objects = render()
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        [
            "CustomResourceDefinition",
            "CustomResourceDefinition",
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "ClusterKopfPeering",
            "Deployment",
            "FlowSchema",
        ]
    )
    for obj in objects:
        if obj["kind"] == "CustomResourceDefinition":
            continue
        labels = obj["metadata"]["labels"]
        for key in ("name", "instance", "version", "component", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels, (obj["kind"], key)


def test_deployment_runs_two_peered_replicas_cluster_wide(render):
    (deployment,) = by_kind(render(), "Deployment")
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ppojob/operator:0.1.0"
    assert "--peering=ppojob-ppojob-operator" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--namespace")], "all namespaces by default"
    assert "--launcher=ray-jobs" in container["args"] and "--gang-schedulers=Coscheduling" in container["args"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "512Mi"}
    (peering,) = by_kind(render(), "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "ppojob-ppojob-operator"


def test_pods_meet_the_restricted_pod_security_standard(render):
    (deployment,) = by_kind(render(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["runAsNonRoot"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
    assert not pod.get("hostNetwork") and not pod.get("hostPID")


def rules_of(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_rbac_is_least_privilege(render):
    role, discovery = by_kind(render(), "ClusterRole")
    assert rules_of(discovery) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("", "namespaces"): {"list", "watch"},
    }
    rules = rules_of(role)
    assert "*" not in {v for verbs in rules.values() for v in verbs}
    assert rules[("", "pods")] == {"get", "list", "watch", "delete"}, "it deletes only duplicate head pods; never creates or patches"
    assert rules[("", "secrets")] == {"get", "create"}, "existence checks, and each job's Ray token (never listed)"
    assert rules[("networking.k8s.io", "networkpolicies")] == {"create"}, "the garbage collector deletes them"
    assert rules[("ppojob.io", "ppojobs/status")] == {"get", "patch", "update"}
    assert rules[("scheduling.x-k8s.io", "podgroups")] >= {"create", "delete"}
    assert ("kueue.x-k8s.io", "workloads") not in rules, "only the configured gang schedulers"
    # The API server lets the operator grant (in each trainer's Role) only what it holds itself.
    trainer = build_role(Job.from_body({"metadata": {"name": "tiny", "namespace": "team-a", "uid": "u1"}}))
    for resource, verbs in rules_of(trainer).items():
        assert verbs <= rules.get(resource, set()), (resource, verbs)
    binding, _ = by_kind(render(), "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ppojob-ppojob-operator", "namespace": "ppojob-system"}
    ]


def test_the_operator_may_create_every_child_it_builds(render):
    role, _ = by_kind(render(), "ClusterRole")
    rules = rules_of(role)
    job = Job.from_body({"metadata": {"name": "tiny", "namespace": "team-a", "uid": "u1"}, "spec": {"image": "x"}})
    spec, _ = job.parse()
    backend = backend_for(GangScheduler.COSCHEDULING)
    children = [build_service_account(job), build_role(job), build_role_binding(job), build_progress_configmap(job),
                build_ray_token_secret(job, token="t"), build_network_policy(job, options=BuildOptions()),
                build_pod_group(job, spec, attempt=0, backend=backend),
                build_raycluster(job, spec, attempt=0, backend=backend, options=BuildOptions())]
    for child in children:
        group = child["apiVersion"].rpartition("/")[0]
        assert "create" in rules.get((group, PLURALS[child["kind"]]), set()), child["kind"]


def test_the_operator_knows_its_pods_for_the_jobs_network_policies(render):
    (deployment,) = by_kind(render(), "Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    labels = dict(a.removeprefix("--operator-pod-label=").split("=", 1) for a in container["args"]
                  if a.startswith("--operator-pod-label="))
    assert labels == deployment["spec"]["selector"]["matchLabels"] and labels.items() <= pod["metadata"]["labels"].items()
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_watch_namespaces_gives_namespaced_roles(render):
    objects = render("watchNamespaces={team-a,team-b}")
    assert [r["metadata"]["name"] for r in by_kind(objects, "ClusterRole")] == ["ppojob-ppojob-operator-discovery"]
    assert not by_kind(objects, "ClusterKopfPeering")
    assert sorted(r["metadata"]["namespace"] for r in by_kind(objects, "Role")) == ["team-a", "team-b"]
    assert sorted(p["metadata"]["namespace"] for p in by_kind(objects, "KopfPeering")) == ["team-a", "team-b"]
    (deployment,) = by_kind(objects, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_metrics_service_is_optional(render):
    assert not by_kind(render(), "Service")
    objects = render("metrics.enabled=true")
    (service,) = by_kind(objects, "Service")
    assert service["spec"]["ports"][0]["port"] == 9090
    (deployment,) = by_kind(objects, "Deployment")
    assert "--metrics-port=9090" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "annotations" not in service["metadata"]
    (annotated,) = by_kind(render("metrics.enabled=true", "metrics.scrapeAnnotations=true", "metrics.port=9100"), "Service")
    assert annotated["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9100", "prometheus.io/path": "/metrics"}
    assert annotated["spec"]["ports"][0]["port"] == 9100


def test_the_operators_requests_get_a_priority_level_of_their_own(render):
    (schema,) = by_kind(render(), "FlowSchema")
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == "workload-high"
    assert schema["spec"]["matchingPrecedence"] < 9000  # before the API server's service-accounts schema
    (rule,) = schema["spec"]["rules"]
    (subject,) = rule["subjects"]
    (account,) = by_kind(render(), "ServiceAccount")
    assert subject == {"kind": "ServiceAccount", "serviceAccount": {
        "name": account["metadata"]["name"], "namespace": account["metadata"]["namespace"]}}
    assert not by_kind(render("flowControl.priorityLevel="), "FlowSchema")


def test_gang_scheduler_rbac_follows_values(render):
    role, _ = by_kind(render("gangSchedulers={Kueue}"), "ClusterRole")
    rules = rules_of(role)
    assert ("scheduling.x-k8s.io", "podgroups") not in rules
    assert rules[("kueue.x-k8s.io", "workloads")] == {"list", "watch"}, "watched, never written"
    assert rules[("kueue.x-k8s.io", "localqueues")] == {"get"}, "an existence check, never listed"
    assert not {resource for group, resource in rules if group == "kueue.x-k8s.io"} - {"workloads", "localqueues"}


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("replicas=0", "replicas"),
        ("trainerLauncher=Kubectl", "trainerLauncher"),
        ("watchNamespaces={Bad_NS}", "watchNamespaces"),
        ("imagee.tag=x", "imagee"),
        ("crds.keep=maybe", "crds"),
        ("crds.kept=true", "kept"),
        ("flowControl.priorityLevel=Workload_High", "priorityLevel"),
    ],
)
def test_bad_values_are_rejected_with_the_field(render, setting, fragment):
    with pytest.raises(subprocess.CalledProcessError) as info:
        render(setting)
    assert "values don't meet the specifications of the schema" in info.value.stderr
    assert fragment in info.value.stderr


def test_values_file_passes_its_schema(helm):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["trainerLauncher"] in ("ray-jobs", "local")


def test_crds_are_part_of_the_release_unless_turned_off(render):
    names = sorted(o["metadata"]["name"] for o in by_kind(render(), "CustomResourceDefinition"))
    assert names == ["clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev", "ppojobs.ppojob.io"]
    assert not by_kind(render("crds.install=false"), "CustomResourceDefinition")


def crd_named(objects: list[dict], name: str) -> dict:
    (crd,) = [o for o in by_kind(objects, "CustomResourceDefinition") if o["metadata"]["name"] == name]
    return crd


def test_ppojob_crd_is_kept_on_uninstall_by_default(render):
    objects = render()
    annotations = crd_named(objects, "ppojobs.ppojob.io")["metadata"].get("annotations", {})
    assert annotations.get("helm.sh/resource-policy") == "keep", "helm uninstall would delete every PPOJob"
    for name in ("clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        assert "annotations" not in crd_named(objects, name)["metadata"], "kopf's peering CRDs go with the release"


def test_crds_keep_false_lets_uninstall_delete_the_crd(render):
    crd = crd_named(render("crds.keep=false"), "ppojobs.ppojob.io")
    assert "helm.sh/resource-policy" not in crd["metadata"].get("annotations", {})


@pytest.mark.parametrize("keep", ["true", "false"])
def test_rendered_crds_are_the_files_but_for_the_keep_annotation(render, keep):
    files = [
        doc
        for path in sorted((CHART / "files" / "crds").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    rendered = by_kind(render(f"crds.keep={keep}"), "CustomResourceDefinition")
    for crd in rendered:
        annotations = crd["metadata"].pop("annotations", {})
        assert annotations == ({"helm.sh/resource-policy": "keep"} if keep == "true" and
                               crd["metadata"]["name"] == "ppojobs.ppojob.io" else {})
    key = lambda o: o["metadata"]["name"]
    assert sorted(rendered, key=key) == sorted(files, key=key)


def test_crds_values_are_documented_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    crds = schema["properties"]["crds"]["properties"]
    assert set(crds) == {"install", "keep"}
    for name, prop in crds.items():
        assert prop["type"] == "boolean" and len(prop.get("description", "")) > 20, name
    assert "kubectl delete ppojobs --all -A" in crds["keep"]["description"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["crds"] == {"install": True, "keep": True}


TEARDOWN = ("kubectl delete ppojobs --all -A", "helm uninstall ppojob -n ppojob-system",
            "kubectl delete crd ppojobs.ppojob.io")


@pytest.mark.parametrize("page", ["README.md", "docs/chart.md"])
def test_the_documented_teardown_is_in_its_order(page):
    text = (REPO / page).read_text()
    at = [text.find(command) for command in TEARDOWN]
    assert -1 not in at and at == sorted(at), f"{page}: the teardown is {TEARDOWN}, in that order"
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "kubectl delete ppojobs --all -A" in notes and "kubectl delete crd ppojobs.ppojob.io" in notes
