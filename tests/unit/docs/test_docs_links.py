"""Every relative link in the manual resolves: README.md, docs/**/*.md and bench/README.md.

A link's file must exist (relative to the page), and its #anchor must be a heading of that page
(GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats). Paths
named in code spans (`docs/gpu.md`, `bench/gpu_ppo_step.py`) must exist too, so that a page
never sends a reader to a file that has gone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ppojob_api.reference import slug

REPO = Path(__file__).resolve().parents[3]
PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", *(REPO / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
REPO_PATH = re.compile(r"^(?:api|bench|charts|crds|docs|examples|images|operator|tests|trainer)/[\w.\-/]*\w$")


def prose(text: str) -> str:
    """The page without its fenced code blocks (links in code are not links)."""
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(prose(page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", prose(page.read_text()))
    return LINK.findall(text) + REFERENCE_LINK.findall(text)


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # https:, mailto:, ...
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{target}: no such file")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], f"{page.relative_to(REPO)}: broken links"


def missing_paths(page: Path) -> list[str]:
    """Repository paths in the page's code spans (`path`, `path::name`, `path:name`) that do not exist."""
    missing = []
    for _, span in CODE_SPAN.findall(prose(page.read_text())):
        words = span.strip().split("::")[0].split(":")[0].split()
        candidate = words[0] if words else ""
        if REPO_PATH.match(candidate) and not (REPO / candidate).exists():
            missing.append(candidate)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_repository_path_in_code_spans_exists(page):
    assert missing_paths(page) == [], f"{page.relative_to(REPO)} names files that do not exist"


def test_the_link_checker_catches_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n## A gang stuck `Pending`\n\n[ok](#a-gang-stuck-pending) [self](a.md#title) "
                    "[gone](b.md) [no anchor](a.md#nowhere) [web](https://example.com) `[in code](c.md)`\n\n"
                    "```\n[fenced](d.md)\n```\n\n[ref]: e.md\n")
    assert broken_links(page) == ["b.md: no such file", "a.md#nowhere: no heading #nowhere", "e.md: no such file"]


def test_the_path_check_catches_a_file_that_is_gone(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("`docs/no-such-page.md`, `trainer/ppo_trainer/train.py::train`, `bench/nothing.py --out X`, "
                    "`<state>/logs`\n")
    assert missing_paths(page) == ["docs/no-such-page.md", "bench/nothing.py"]
