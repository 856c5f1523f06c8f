"""The PPOJob reference (docs/reference.md), generated from the CRD, the API's one source of truth.

Every field of spec and status with its type, default, bounds or allowed values and description,
the printer columns, and the CEL rules with the messages the API server answers. Reads only the
CRD's YAML; imports nothing of the operator or the trainer.

    python -m ppojob_api.reference            # rewrite docs/reference.md (make docs-reference)
    python -m ppojob_api.reference --check    # exit 1 when docs/reference.md differs from the CRD
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "ppojobs.ppojob.io.yaml"
REFERENCE_PATH = REPO / "docs" / "reference.md"


@dataclass(frozen=True)
class Rule:
    """One x-kubernetes-validations entry and the schema path it sits on."""

    number: int
    on: str
    rule: str
    message: str
    message_is_expression: bool
    field_path: str
    reason: str


def load_crd(path: Path = CRD_PATH) -> dict:
    return yaml.safe_load(path.read_text())


def storage_version(crd: dict) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version


def code(text: str, *, table: bool = True) -> str:
    """An inline code span that survives backticks in the text and, in a table, pipes."""
    text = str(text).replace("|", "\\|") if table else str(text)
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def cell(text: str) -> str:
    """Prose in a table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def value(v) -> str:
    """A default or bound as YAML would accept it back."""
    if isinstance(v, str):
        return code(json.dumps(v)) if v in ("", "None", "true", "false", "null") or v != v.strip() else code(v)
    return code(json.dumps(v, separators=(", ", ": ")))


def type_of(schema: dict) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map of {type_of(schema['additionalProperties'])}"
    if kind == "object" and schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return "object (any fields)"
    if schema.get("format"):
        return f"{kind} ({schema['format']})"
    return kind


def bounds_of(schema: dict) -> list[str]:
    out = []
    if "enum" in schema:
        out.append("one of " + ", ".join(value(v) for v in schema["enum"]))
    if "minimum" in schema:
        out.append(("> " if schema.get("exclusiveMinimum") else "≥ ") + str(schema["minimum"]))
    if "maximum" in schema:
        out.append(("< " if schema.get("exclusiveMaximum") else "≤ ") + str(schema["maximum"]))
    for key, label in (("minLength", "length ≥"), ("maxLength", "length ≤"),
                       ("minItems", "items ≥"), ("maxItems", "items ≤")):
        if key in schema:
            out.append(f"{label} {schema[key]}")
    if "pattern" in schema:
        out.append("matches " + code(schema["pattern"]))
    if schema.get("x-kubernetes-list-type"):
        keys = schema.get("x-kubernetes-list-map-keys")
        out.append(f"list type {schema['x-kubernetes-list-type']}" + (f" keyed by {', '.join(keys)}" if keys else ""))
    return out


def collect_rules(schema: dict, path: str, rules: list[Rule]) -> None:
    for entry in schema.get("x-kubernetes-validations", []):
        has_expression = "messageExpression" in entry
        rules.append(Rule(number=len(rules) + 1, on=path, rule=entry["rule"],
                          message=entry.get("messageExpression") if has_expression else entry.get("message", ""),
                          message_is_expression=has_expression,
                          field_path=entry.get("fieldPath", ""), reason=entry.get("reason", "")))
    for name, child in schema.get("properties", {}).items():
        collect_rules(child, f"{path}.{name}", rules)
    if isinstance(schema.get("items"), dict):
        collect_rules(schema["items"], f"{path}[]", rules)


def rule_target(rule: Rule) -> str:
    """The field a rule reports on: its fieldPath below the object it sits on, else that object."""
    return rule.on + rule.field_path if rule.field_path else rule.on


def has_fields(schema: dict) -> bool:
    return bool(schema.get("properties")) or bool(schema.get("items", {}).get("properties"))


def object_sections(schema: dict, path: str, out: list[tuple[str, dict]]) -> None:
    """Every object with fields of its own, depth first: (path, schema)."""
    if schema.get("properties"):
        out.append((path, schema))
        for name, child in schema["properties"].items():
            if has_fields(child):
                object_sections(child, f"{path}.{name}", out)
    elif schema.get("items", {}).get("properties"):
        object_sections(schema["items"], f"{path}[]", out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading (the one docs/ links use)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def field_table(path: str, schema: dict, rules: list[Rule], sections: set[str]) -> list[str]:
    required = set(schema.get("required", []))
    lines = ["| field | type | default | bounds, values | description |", "| --- | --- | --- | --- | --- |"]
    for name, child in schema["properties"].items():
        full = f"{path}.{name}"
        kind = type_of(child)
        target = full if full in sections else f"{full}[]" if f"{full}[]" in sections else None
        if target:
            kind = f"[{kind}](#{slug(target)})"
        default = value(child["default"]) if "default" in child else ("required" if name in required else "")
        notes = [cell(child.get("description", ""))] if child.get("description") else []
        checked = [r for r in rules if rule_target(r) == full]
        if checked:
            notes.append("Checked by " + ", ".join(f"[rule {r.number}](#rule-{r.number})" for r in checked) + ".")
        lines.append(f"| {code(name)} | {kind} | {default} | {'; '.join(bounds_of(child))} | {' '.join(notes)} |")
    return lines


def render(crd: dict, source: str = "crds/ppojobs.ppojob.io.yaml") -> str:
    names = crd["spec"]["names"]
    version = storage_version(crd)
    schema = version["schema"]["openAPIV3Schema"]
    group = crd["spec"]["group"]
    rules: list[Rule] = []
    for top, child in schema.get("properties", {}).items():
        collect_rules(child, top, rules)
    sections: list[tuple[str, dict]] = []
    for top in ("spec", "status"):
        if top in schema.get("properties", {}):
            object_sections(schema["properties"][top], top, sections)
    section_paths = {p for p, _ in sections}

    out = [
        f"# {names['kind']} reference",
        "",
        f"Generated from [`{source}`](../{source}) by `make docs-reference` (`python -m ppojob_api.reference`,",
        "`api/ppojob_api/reference.py`); do not edit by hand. `tests/unit/docs/test_docs_reference.py` fails",
        "when this page and the CRD differ.",
        "",
        f"{schema.get('description', '')}",
        "",
        "| | |",
        "| --- | --- |",
        f"| apiVersion | `{group}/{version['name']}` |",
        f"| kind | `{names['kind']}` (list: `{names.get('listKind', names['kind'] + 'List')}`) |",
        f"| scope | {crd['spec'].get('scope', 'Namespaced')} |",
        f"| names | `{names['plural']}`, `{names['singular']}`"
        + "".join(f", `{s}`" for s in names.get("shortNames", [])) + " |",
        f"| categories | {', '.join(f'`{c}`' for c in names.get('categories', [])) or '–'} |",
        f"| status subresource | {'yes' if 'status' in version.get('subresources', {}) else 'no'} |",
        "",
        "Defaults are filled in by the API server when the job is stored; every object with a default of",
        "`{}` is filled in with the defaults of its own fields, so an empty spec section means all its",
        "defaults. Values outside the bounds are refused; so are unknown fields by `kubectl apply` (its",
        "default strict field validation), which the API server otherwise drops.",
        "",
        "## Contents",
        "",
        "- [Printer columns](#printer-columns)",
        "- [Validation rules](#validation-rules)",
    ]
    for path, _ in sections:
        depth = path.count(".")
        out.append(f"{'  ' * depth}- [{path}](#{slug(path)})")
    out += ["", "## Printer columns", "",
            "`kubectl get ppojobs` shows these columns (`-o wide` adds those of priority 1).", "",
            "| column | type | from | priority | description |", "| --- | --- | --- | --- | --- |"]
    for column in version.get("additionalPrinterColumns", []):
        out.append(f"| {column['name']} | {column['type']} | {code(column['jsonPath'])} | "
                   f"{column.get('priority', 0)} | {cell(column.get('description', ''))} |")
    out += ["", "## Validation rules", "",
            "CEL rules the API server checks on every create and update (`x-kubernetes-validations`); a job",
            "that breaks one is refused with the message below, reported on the field it names.", ""]
    for r in rules:
        out.append(f"### Rule {r.number}")
        out.append("")
        out.append(f"- on: `{r.on}`" + (f", reported at `{r.field_path}`" if r.field_path else ""))
        out.append(f"- rule: {code(r.rule, table=False)}")
        label = "message (a CEL expression)" if r.message_is_expression else "message"
        out.append(f"- {label}: {code(r.message, table=False) if r.message_is_expression else r.message}")
        if r.reason:
            out.append(f"- reason: `{r.reason}`")
        out.append("")
    for path, section in sections:
        out += [f"## {path}", ""]
        if section.get("description"):
            out += [cell(section["description"]), ""]
        out += field_table(path, section, rules, section_paths)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppojob_api.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--crd", type=Path, default=CRD_PATH, help="the CRD's YAML (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH, help="the page to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is out of date")
    args = parser.parse_args(argv)
    text = render(load_crd(args.crd))
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date with {args.crd}: run make docs-reference", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
