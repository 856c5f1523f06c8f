"""data.validation: held-out prompts parse with their defaults; bad values are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ppojob_api.spec import VALIDATION_NEEDS_PROMPTS, SpecError, parse_spec, to_manifest_dict

CRD = Path(__file__).resolve().parents[3] / "crds" / "ppojobs.ppojob.io.yaml"


def parse(validation: dict):
    return parse_spec({"image": "ppojob/trainer:test", "data": {"validation": validation}})


def problems_of(validation: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse(validation)
    return info.value.problems


def test_validation_is_off_by_default_and_leaves_the_manifest_unchanged():
    spec = parse_spec({"image": "ppojob/trainer:test"})
    assert not spec.data.validation.enabled
    assert to_manifest_dict(spec)["data"] == {"prompts": "synthetic", "promptKey": "prompt", "labelKey": "label",
                                              "validation": {}}


def test_validation_reads_every_setting():
    validation = parse({"prompts": "/data/test.jsonl", "count": "50", "interval": 5, "temperature": 0.7,
                        "maxNewTokens": 128}).data.validation
    assert validation.enabled
    assert (validation.prompts, validation.count, validation.interval, validation.temperature,
            validation.max_new_tokens) == ("/data/test.jsonl", 50, 5, 0.7, 128)


@pytest.mark.parametrize(
    "validation, field",
    [
        ({"prompts": "p.jsonl", "count": -1}, "spec.data.validation.count"),
        ({"prompts": "p.jsonl", "interval": -2}, "spec.data.validation.interval"),
        ({"prompts": "p.jsonl", "temperature": -0.5}, "spec.data.validation.temperature"),
        ({"prompts": "p.jsonl", "maxNewTokens": 0}, "spec.data.validation.maxNewTokens"),
        ({"prompts": ""}, "spec.data.validation.prompts"),
        ({"prompts": "p.jsonl", "every": 3}, "spec.data.validation.every: unknown field"),
    ],
)
def test_bad_validation_values_name_the_field(validation, field):
    (problem,) = problems_of(validation)
    assert problem.startswith(field), problem


def test_validation_settings_without_prompts_are_refused_with_the_crd_rules_message():
    assert problems_of({"interval": 5}) == [VALIDATION_NEEDS_PROMPTS]
    crd = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert VALIDATION_NEEDS_PROMPTS in [rule.get("message") for rule in crd["x-kubernetes-validations"]]
