"""pyproject.toml as setuptools reads it: the license an SPDX expression, with no deprecation warning."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

from packaging.licenses import canonicalize_license_expression
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution
from setuptools.warnings import SetuptoolsDeprecationWarning

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_license_is_a_canonical_spdx_expression():
    license_ = tomllib.loads(PYPROJECT.read_text())["project"]["license"]
    assert isinstance(license_, str), "project.license must be an SPDX string, not a table"
    assert canonicalize_license_expression(license_) == license_


def test_setuptools_reads_the_project_without_deprecation_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), str(PYPROJECT))
    deprecations = [str(w.message) for w in caught if issubclass(w.category, SetuptoolsDeprecationWarning)]
    assert deprecations == []
    assert distribution.metadata.license_expression == "Apache-2.0"
