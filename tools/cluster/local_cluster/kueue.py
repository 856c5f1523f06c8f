"""Kueue on the local cluster: its controller manager built from the Go module sigs.k8s.io/kueue at
the pinned KUEUE_VERSION, run as a process like the other components, with the RayCluster
integration only.

Kueue needs newer k8s.io libraries than the pinned control plane, so it is built in a wrapper
module and a cache directory of its own, keyed by its pin alone: changing it rebuilds Kueue, not
the cluster. Its CRDs and webhook configurations come from the module (never committed); the
webhooks call https://127.0.0.1 with a serving certificate from the cluster's CA. The RayCluster
webhooks only see RayClusters that carry a queue name, so every other RayCluster is created
whether Kueue runs or not. `ensure_running` adds Kueue to a cluster started without it.
Depends on `build` (Go helpers), `pins`, `pki`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from . import build as builder
from .pins import Pins, cache_root
from .pki import SERVER, _sign

if TYPE_CHECKING:
    from .cluster import LocalCluster

MODULE = "sigs.k8s.io/kueue"
PACKAGE = "sigs.k8s.io/kueue/cmd/kueue"
NAME = "kueue"
NAMESPACE = "kueue-system"
RECIPE = "1"
"""Bump when the way Kueue is built changes: forces a rebuild."""
PORTS = {"kueue-webhook": 16480, "kueue-probe": 16481}
FRAMEWORKS = ("ray.io/raycluster",)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# The visibility API server (an aggregated APIService on its own port) is not used here.
FEATURE_GATES = "VisibilityOnDemand=false"
CRD_NAMES = (
    "admissionchecks", "clusterqueues", "cohorts", "localqueues", "multikueueclusters", "multikueueconfigs",
    "provisioningrequestconfigs", "resourceflavors", "topologies", "workloadpriorityclasses", "workloads",
)
# With its internal cert management off, Kueue loads a metrics certificate from this fixed path at
# start (cmd/kueue/main.go), metrics served or not: the webhook's certificate is put there too.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
WEBHOOK_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}


def build_dir(pins: Pins) -> Path:
    """<cache>/cluster/kueue-<key>/, keyed by KUEUE_VERSION and RECIPE only."""
    key = hashlib.sha256(f"{pins['KUEUE_VERSION']}\nrecipe={RECIPE}".encode()).hexdigest()[:12]
    return cache_root() / "cluster" / f"kueue-{key}"


def binary(pins: Pins) -> Path:
    return build_dir(pins) / "bin" / NAME


def build(pins: Pins, *, force: bool = False, out=None) -> dict:
    """Build the Kueue binary unless cached; returns the build record (timings, module dir)."""
    version = pins["KUEUE_VERSION"]
    return builder.build_apart(
        NAME, module=MODULE, version=version, package=PACKAGE, root=build_dir(pins), force=force, out=out,
        ldflags=f"-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion={version}",
    )


def module_dir(pins: Pins) -> Path:
    record_file = build_dir(pins) / "build.json"
    path = Path(json.loads(record_file.read_text()).get("module_dir", "")) if record_file.is_file() else Path()
    if not path.is_dir() or not binary(pins).is_file():
        raise builder.BuildError(f"{MODULE} {pins['KUEUE_VERSION']} is not built or not in the Go module cache; "
                                 "run `python -m local_cluster build`")
    return path


def crd_files(pins: Pins) -> list[Path]:
    bases = module_dir(pins) / "config" / "components" / "crd" / "bases"
    return [bases / f"kueue.x-k8s.io_{name}.yaml" for name in CRD_NAMES]


def _is_kept(webhook: dict) -> bool:
    """Kueue's own objects' webhooks and the RayCluster ones: the only integration enabled here."""
    rules = webhook.get("rules") or []
    return any("kueue.x-k8s.io" in r.get("apiGroups", []) or "rayclusters" in r.get("resources", []) for r in rules)


def webhook_configurations(pins: Pins, ca_bundle: str) -> list[dict]:
    """Kueue's webhook configurations from its module, calling this machine's Kueue by URL."""
    manifests = module_dir(pins) / "config" / "components" / "webhook" / "manifests.yaml"
    result = []
    for doc in yaml.safe_load_all(manifests.read_text()):
        if not doc or doc.get("kind") not in WEBHOOK_CONFIGURATIONS:
            continue
        webhooks = []
        for webhook in filter(_is_kept, doc["webhooks"]):
            path = webhook["clientConfig"]["service"]["path"]
            webhook = {**webhook, "clientConfig": {"url": f"https://127.0.0.1:{PORTS['kueue-webhook']}{path}",
                                                   "caBundle": ca_bundle}}
            if "rayclusters" in str(webhook["rules"]):
                webhook["objectSelector"] = {"matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]}
            webhooks.append(webhook)
        result.append({"apiVersion": doc["apiVersion"], "kind": doc["kind"],
                       "metadata": {"name": WEBHOOK_CONFIGURATIONS[doc["kind"]]}, "webhooks": webhooks})
    return result


def configuration(cert_dir: Path) -> str:
    """Kueue's Configuration: loopback ports, certificates given (no internal rotation), no leader election."""
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{PORTS['kueue-probe']}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": PORTS["kueue-webhook"], "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": list(FRAMEWORKS)},
    }
    return yaml.safe_dump(config, sort_keys=False)


def _serving_cert(cluster: LocalCluster) -> Path:
    """tls.crt/tls.key for 127.0.0.1, signed by the cluster's CA (kept with the PKI)."""
    pki = cluster.state_dir / "pki"
    if not (pki / "kueue-webhook.crt").is_file():
        _sign(pki, "kueue-webhook", "/CN=kueue-webhook", SERVER + "subjectAltName=IP:127.0.0.1\n")
        (pki / "kueue-webhook.key").chmod(0o600)
    cert_dir = cluster.state_dir / "certs" / NAME
    for folder in (cert_dir, METRICS_CERT_DIR):
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pki / "kueue-webhook.crt", folder / "tls.crt")
        shutil.copyfile(pki / "kueue-webhook.key", folder / "tls.key")
    return cert_dir


def ready(cluster: LocalCluster) -> bool:
    return cluster._get(f"http://127.0.0.1:{PORTS['kueue-probe']}/readyz")[0] == 200


def start(cluster: LocalCluster, record: dict, deadline: float, out=None) -> None:
    """CRDs established, the controller manager started and ready, then its webhooks registered
    (registered before it answers, they would refuse every queued RayCluster meanwhile)."""
    started = time.monotonic()
    build(cluster.pins, out=out)
    args = ["apply", "--server-side", "--force-conflicts"]
    for path in crd_files(cluster.pins):
        args += ["-f", str(path)]
    cluster.kubectl(*args)
    cluster.wait_established(*[f"{name}.kueue.x-k8s.io" for name in CRD_NAMES])
    cluster.apply(yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}))
    config = cluster.state_dir / "config" / "kueue.yaml"
    config.write_text(configuration(_serving_cert(cluster)))
    cluster._spawn(NAME, [f"--config={config}", f"--feature-gates={FEATURE_GATES}", "--zap-log-level=info"],
                   record, binary=binary(cluster.pins))
    cluster._wait(NAME, lambda: ready(cluster), deadline)
    ca_bundle = base64.b64encode((cluster.state_dir / "pki" / "ca.crt").read_bytes()).decode()
    cluster.apply(yaml.safe_dump_all(webhook_configurations(cluster.pins, ca_bundle)))
    _say(out, f"kueue ready in {time.monotonic() - started:.1f}s")


def ensure_running(cluster: LocalCluster, timeout: float = 180) -> None:
    """Kueue on a running cluster that was started without it (or whose Kueue died): started and
    recorded, so that `down` stops it with the rest."""
    from .cluster import _alive, _locked  # cluster imports this module

    with _locked(cluster.state_dir):
        record = cluster._read_record()
        process = (record or {}).get("processes", {}).get(NAME)
        if process is not None and _alive(process) and ready(cluster):
            return
        cluster._t0, cluster._ready_at = time.monotonic(), {}
        start(cluster, record, time.monotonic() + timeout)


def _say(out, text: str) -> None:
    if out is not None:
        print(text, file=out, flush=True)
