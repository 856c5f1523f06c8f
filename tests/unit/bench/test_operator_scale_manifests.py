"""The scale benchmark's objects: what they point at exists in the CRD they are measured against."""

from pathlib import Path

import operator_scale_manifests as manifests
import yaml

CRD = Path(__file__).resolve().parents[3] / "crds" / "ppojobs.ppojob.io.yaml"


def test_gc_probe_is_owned_by_a_ppojob_of_the_served_version():
    crd = yaml.safe_load(CRD.read_text())
    served = {f"{crd['spec']['group']}/{v['name']}" for v in crd["spec"]["versions"] if v["served"]}
    probe = manifests.gc_probe("0f9c2c1e-7d3a-4b61-9a4e-2f6d1c0b8a57")
    (owner,) = probe["metadata"]["ownerReferences"]
    assert owner["kind"] == crd["spec"]["names"]["kind"] and owner["apiVersion"] in served
    assert owner["uid"] == "0f9c2c1e-7d3a-4b61-9a4e-2f6d1c0b8a57"
    assert probe["kind"] == "ConfigMap" and probe["metadata"]["namespace"] == "default"
