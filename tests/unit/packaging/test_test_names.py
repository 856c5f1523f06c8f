"""Test modules are imported by their file name alone (pytest's default import mode, which the
`from conftest import` helpers need), so two test files of one name anywhere under tests/ stop the
whole run at collection."""

from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_every_test_file_name_is_unique_under_tests():
    by_name = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not repeated, f"rename one of each: {repeated}"
