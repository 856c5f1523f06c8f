"""docs/reference.md is generated from the CRD (api/ppojob_api/reference.py): the two must not drift."""

from __future__ import annotations

import copy

from ppojob_api import reference

CONTRIBUTORS = "run `make docs-reference` (python -m ppojob_api.reference) after changing crds/ppojobs.ppojob.io.yaml"


def test_reference_page_is_generated_from_the_current_crd():
    page = reference.REFERENCE_PATH.read_text()
    assert page == reference.render(reference.load_crd()), CONTRIBUTORS


def test_reference_names_every_field_with_its_default_and_bounds():
    crd = reference.load_crd()
    page = reference.render(crd)
    schema = reference.storage_version(crd)["schema"]["openAPIV3Schema"]
    sections = []
    reference.object_sections(schema["properties"]["spec"], "spec", sections)
    reference.object_sections(schema["properties"]["status"], "status", sections)
    for path, section in sections:
        assert f"\n## {path}\n" in page, path
        table = page.split(f"\n## {path}\n", 1)[1].split("\n## ", 1)[0]
        for name, field in section["properties"].items():
            (row,) = [line for line in table.splitlines() if line.startswith(f"| `{name}` |")]
            if "default" in field:
                assert reference.value(field["default"]) in row, (path, name)
            for bound in reference.bounds_of(field):
                assert bound in row, (path, name, bound)


def test_reference_lists_every_cel_rule_with_its_message():
    crd = reference.load_crd()
    page = reference.render(crd)
    spec = reference.storage_version(crd)["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for entry in spec["x-kubernetes-validations"]:
        assert entry["rule"] in page
        assert (entry.get("message") or entry["messageExpression"]) in page


def test_reference_changes_when_the_crd_changes():
    crd = reference.load_crd()
    changed = copy.deepcopy(crd)
    spec = reference.storage_version(changed)["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["seed"]["default"] = 7
    spec["properties"]["seed"]["description"] = "a changed description"
    assert reference.render(changed) != reference.render(crd)
    assert "a changed description" in reference.render(changed)


def test_reference_check_reports_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "reference.md"
    stale.write_text("# stale\n")
    assert reference.main(["--out", str(stale), "--check"]) == 1
    assert "make docs-reference" in capsys.readouterr().err
    assert reference.main(["--out", str(stale)]) == 0
    assert reference.main(["--out", str(stale), "--check"]) == 0


def test_heading_slugs_are_githubs():
    assert reference.slug("spec.ppo.rolloutCorrection") == "specpporolloutcorrection"
    assert reference.slug("status.conditions[]") == "statusconditions"
    assert reference.slug("A gang stuck `Pending`") == "a-gang-stuck-pending"
    assert reference.slug("/dev/shm too small") == "devshm-too-small"
