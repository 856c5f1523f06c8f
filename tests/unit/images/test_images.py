"""The images: lint-clean Dockerfiles, and entrypoints that work as plain processes here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))


def instruction(dockerfile: Path, name: str) -> list[str]:
    (line,) = [l for l in dockerfile.read_text().splitlines() if l.startswith(name + " ")]
    return json.loads(line[len(name) + 1 :])


def test_there_is_an_operator_and_a_trainer_image():
    assert [p.parent.name for p in DOCKERFILES] == ["operator", "trainer"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_is_lint_clean(dockerfile):
    result = subprocess.run([str(BIN / "hadolint"), str(dockerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_image_runs_as_non_root(dockerfile):
    users = re.findall(r"^USER (\S+)", dockerfile.read_text(), re.MULTILINE)
    assert users and not users[-1].startswith(("0", "root"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_entrypoint_works_as_a_plain_process(dockerfile):
    (command,) = instruction(dockerfile, "ENTRYPOINT")
    result = subprocess.run([str(BIN / command), "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


def test_operator_image_pulls_no_torch_or_ray():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["operator"]
    assert not [d for d in deps if re.match(r"(torch|ray|transformers)\b", d)]
    assert "'.[operator]'" in (REPO / "images/operator/Dockerfile").read_text()


def test_operator_imports_without_torch():
    code = "import sys, ppo_operator.main; print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("dockerfile", "default"),
    [("operator", "python:3.11-slim"), ("trainer", "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04")],
)
def test_dockerfile_takes_its_base_as_a_build_argument_with_the_production_default(dockerfile, default):
    text = (REPO / "images" / dockerfile / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={default}\n" in text
    bases = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert bases and set(bases) == {"${BASE_IMAGE}"}, bases


def test_trainer_image_runs_as_ray_with_uid_1000_and_a_bash_login_shell():
    text = (REPO / "images/trainer/Dockerfile").read_text()
    assert "useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash ray" in text
    assert re.findall(r"^USER (\S+)", text, re.MULTILINE)[-1] == "1000:1000"
    assert "/etc/profile.d/" in text  # a login shell (KubeRay's bash -l) resets PATH on Debian
