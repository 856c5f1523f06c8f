"""Print the project's requirements (its dependencies and those of the named extras) from pyproject.toml.

Both Dockerfiles install these in a layer of their own before the source is copied, so that a code
change rebuilds only the project's small layer. Standard library only: it runs on the base image's
Python before anything is installed. Usage: python project_requirements.py EXTRA[,EXTRA...]
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def project_requirements(pyproject: dict, extras: list[str]) -> list[str]:
    """The project's dependencies followed by each extra's, in order, each requirement once."""
    project = pyproject["project"]
    known = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in known]
    if unknown:
        raise ValueError(f"pyproject.toml has no extra {', '.join(unknown)}; it has: {', '.join(sorted(known))}")
    requirements: list[str] = []
    for requirement in [*project.get("dependencies", []), *(r for extra in extras for r in known[extra])]:
        if requirement not in requirements:
            requirements.append(requirement)
    return requirements


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].strip(","):
        print(f"usage: python {argv[0]} EXTRA[,EXTRA...]   (e.g. trainer,megatron)", file=sys.stderr)
        return 2
    pyproject = tomllib.loads(Path("pyproject.toml").read_text())
    try:
        requirements = project_requirements(pyproject, [e for e in argv[1].split(",") if e])
    except ValueError as err:
        print(f"{argv[0]}: {err}", file=sys.stderr)
        return 2
    print("\n".join(requirements))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
