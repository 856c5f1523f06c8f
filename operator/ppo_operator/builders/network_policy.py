"""build_network_policy: who may open connections to a job's Ray pods.

Ray's nodes talk to each other on many ports (GCS, raylets, object managers, workers, the
dashboard and its agents), so the job's own pods, of every attempt, may reach each other on any
port; the operator's pods may reach the dashboard port only, where they submit and observe the
trainer. Nothing else may connect in; what the pods open outward is not restricted. Enforced only
by a CNI that implements NetworkPolicy. Pure; depends on `names`, `job` and the vocabulary.
"""

from __future__ import annotations

from typing import Any

from ppo_operator import names
from ppo_operator.builders.common import BuildOptions, child_metadata
from ppo_operator.builders.submission import DASHBOARD_PORT
from ppo_operator.job import Job
from ppojob_api.vocabulary import LABEL_JOB_NAME

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set on every namespace by the API server: selects one namespace by its name."""


def _job_pods(job: Job) -> dict[str, Any]:
    return {"matchLabels": {LABEL_JOB_NAME: names.job_label_value(job.name)}}


def build_network_policy(job: Job, *, options: BuildOptions) -> dict[str, Any]:
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": _job_pods(job)}]}]
    if options.operator_namespace is not None:
        operator_pods = {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: options.operator_namespace}},
            "podSelector": {"matchLabels": dict(options.operator_pod_labels)},
        }
        ingress.append({"from": [operator_pods], "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(job, names.network_policy_name(job.name)),
        "spec": {"podSelector": _job_pods(job), "policyTypes": ["Ingress"], "ingress": ingress},
    }
