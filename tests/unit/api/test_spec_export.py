"""checkpoint.export: off until set, its defaults once set, and every bad value refused naming the field."""

from pathlib import Path

import pytest
import yaml

from ppojob_api.spec import EXPORT_CRITIC_NEEDS_A_CRITIC, EXPORT_OFF_THE_VOLUME, SpecError, parse_spec

CRD = Path(__file__).resolve().parents[3] / "crds" / "ppojobs.ppojob.io.yaml"
VOLUME = {"path": "/checkpoints", "volumeClaim": "ppo-checkpoints"}


def spec_with(**checkpoint) -> dict:
    return {"image": "ppojob/trainer:test", "checkpoint": checkpoint}


def problems(raw: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    return info.value.problems


def test_export_is_off_until_set_and_an_empty_export_writes_the_end_only():
    assert parse_spec(spec_with()).checkpoint.export is None
    export = parse_spec(spec_with(export={})).checkpoint.export
    assert (export.interval, export.path, export.dtype, export.critic) == (0, None, None, False)


def test_export_fields_parse_with_their_crd_names():
    export = parse_spec(spec_with(export={"interval": 5, "path": "/out/hf", "dtype": "bfloat16"})).checkpoint.export
    assert (export.interval, export.path, export.dtype) == (5, "/out/hf", "bfloat16")


@pytest.mark.parametrize("export, field", [
    ({"interval": -1}, "spec.checkpoint.export.interval"),
    ({"path": ""}, "spec.checkpoint.export.path"),
    ({"dtype": "float16"}, "spec.checkpoint.export.dtype"),
    ({"critic": "maybe"}, "spec.checkpoint.export.critic"),
])
def test_bad_export_values_are_refused_naming_the_field(export, field):
    (problem,) = problems(spec_with(export=export))
    assert problem.startswith(field + ":"), problem


def test_unknown_export_key_lists_the_valid_ones():
    (problem,) = problems(spec_with(export={"every": 3}))
    assert "valid fields here: interval, path, dtype, critic" in problem


@pytest.mark.parametrize("path", ["/export", "/checkpoints", "/checkpoints/../export", "relative/export"])
def test_export_path_off_the_checkpoint_volume_is_refused(path):
    assert problems(spec_with(**VOLUME, export={"path": path})) == [EXPORT_OFF_THE_VOLUME]


@pytest.mark.parametrize("checkpoint", [
    {**VOLUME, "export": {"path": "/checkpoints/hf"}},
    {**VOLUME, "export": {}},  # the default, <checkpoint.path>/export, is on the volume
    {"path": "/checkpoints", "export": {"path": "/elsewhere"}},  # no claim: a local run's own disk
])
def test_export_path_on_the_volume_or_without_a_claim_is_accepted(checkpoint):
    assert parse_spec(spec_with(**checkpoint)).checkpoint.export is not None


def test_the_crd_states_the_volume_rule_with_the_same_message_on_the_export_path():
    spec = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = [r for r in spec["x-kubernetes-validations"] if r.get("message") == EXPORT_OFF_THE_VOLUME]
    assert rule["fieldPath"] == ".checkpoint.export.path"
    assert "self.checkpoint.export.path.startsWith" in rule["rule"]


def test_exporting_the_critic_needs_one_and_the_crd_says_so_with_the_same_message():
    raw = {**spec_with(export={"critic": True}), "critic": {"enabled": False}}
    assert problems(raw) == [EXPORT_CRITIC_NEEDS_A_CRITIC]
    assert parse_spec(spec_with(export={"critic": True})).checkpoint.export.critic
    spec = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = [r for r in spec["x-kubernetes-validations"] if r.get("message") == EXPORT_CRITIC_NEEDS_A_CRITIC]
    assert rule["fieldPath"] == ".checkpoint.export.critic"
