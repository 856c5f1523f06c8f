"""Test files and their helper modules are imported by their file name alone (pytest's default
import mode puts their folder on sys.path; helpers are imported as `from role_state import ...`), so
two modules of one name in folders without an __init__.py under tests/ shadow each other, and two
test files of one name stop the whole run at collection."""

from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_every_module_imported_by_its_file_name_is_unique_under_tests():
    by_name = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "conftest.py" and not (path.parent / "__init__.py").exists():
            by_name[path.name].append(str(path.relative_to(TESTS)))
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not repeated, f"rename one of each: {repeated}"
