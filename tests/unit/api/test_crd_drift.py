"""The CRD in crds/ is the source of truth; the Python models and vocabulary must follow it."""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from ppojob_api import spec as spec_models
from ppojob_api import vocabulary as vocab

CRD_PATH = Path(__file__).resolve().parents[3] / "crds" / "ppojobs.ppojob.io.yaml"


def load_schema() -> dict:
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def unwrap_optional(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def expected_type(annotation) -> str:
    annotation = unwrap_optional(annotation)
    origin = typing.get_origin(annotation) or annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "string"
    return {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "array"}[origin]


def field_bounds(field) -> dict:
    bounds = {}
    for meta in field.metadata:
        for attr, key in (("ge", "minimum"), ("gt", "minimum"), ("le", "maximum"), ("lt", "maximum")):
            value = getattr(meta, attr, None)
            if value is not None:
                bounds[key] = value
                if attr in ("gt", "lt"):
                    bounds["exclusive" + key.capitalize()] = True
    return bounds


def compare(model: type[BaseModel], schema: dict, path: str, problems: list[str]) -> None:
    props = schema.get("properties", {})
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    for missing in sorted(set(props) - set(fields)):
        problems.append(f"{path}.{missing}: in the CRD, not in {model.__name__}")
    for extra in sorted(set(fields) - set(props)):
        problems.append(f"{path}.{extra}: in {model.__name__}, not in the CRD")
    for key in sorted(set(props) & set(fields)):
        field, prop, where = fields[key], props[key], f"{path}.{key}"
        if expected_type(field.annotation) != prop.get("type"):
            problems.append(f"{where}: type {prop.get('type')} in the CRD, {field.annotation} in Python")
            continue
        inner = unwrap_optional(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            # An object is on by default (`default: {}`, so its defaults apply) or off until set (None in Python).
            if field.default is None and "default" in prop:
                problems.append(f"{where}: None in Python (off until set), but the CRD gives it a default")
            elif field.default is not None and prop.get("default") != {}:
                problems.append(f"{where}: nested objects need `default: {{}}` so their defaults apply")
            compare(inner, prop, where, problems)
            continue
        default = field.default.value if isinstance(field.default, enum.Enum) else field.default
        if field.is_required():
            default = None
        if prop.get("default") != default and not (default is None and "default" not in prop):
            problems.append(f"{where}: default {prop.get('default')!r} in the CRD, {default!r} in Python")
        if (isinstance(inner, type) and issubclass(inner, enum.Enum)
                and sorted(prop.get("enum", [])) != sorted(m.value for m in inner)):
            problems.append(f"{where}: enum {prop.get('enum')} in the CRD, {[m.value for m in inner]}")
        crd_bounds = {k: prop[k] for k in ("minimum", "maximum", "exclusiveMinimum") if k in prop}
        if crd_bounds != field_bounds(field):
            problems.append(f"{where}: bounds {crd_bounds} in the CRD, {field_bounds(field)} in Python")


def test_spec_models_follow_the_crd():
    problems: list[str] = []
    compare(spec_models.PPOJobSpec, load_schema()["properties"]["spec"], "spec", problems)
    assert problems == []


def test_spec_required_fields_match():
    crd_required = set(load_schema()["properties"]["spec"]["required"])
    py_required = {(f.alias or n) for n, f in spec_models.PPOJobSpec.model_fields.items() if f.is_required()}
    assert crd_required == {"image"} and py_required == {"image"}


@pytest.mark.parametrize(
    "path, enum_type",
    [
        (["phase"], vocab.Phase),
        (["progress", "stage"], vocab.Stage),
        (["progress", "actor"], vocab.TrainResidency),
        (["progress", "critic"], vocab.TrainResidency),
        (["progress", "rollout"], vocab.RolloutResidency),
        (["progress", "reward"], vocab.RolloutResidency),
    ],
)
def test_status_enums_follow_the_crd(path, enum_type):
    node = load_schema()["properties"]["status"]
    for key in path:
        node = node["properties"][key]
    assert sorted(node["enum"]) == sorted(m.value for m in enum_type)


def test_names_follow_the_crd():
    crd = yaml.safe_load(CRD_PATH.read_text())
    assert crd["spec"]["group"] == vocab.GROUP
    assert crd["spec"]["names"]["kind"] == vocab.KIND
    assert crd["spec"]["names"]["plural"] == vocab.PLURAL
    assert [v["name"] for v in crd["spec"]["versions"] if v["storage"]] == [vocab.VERSION]
