"""pyproject.toml's metadata, as both builds read it: the venv's (current setuptools, through pip's
isolated build) and the .deb's (the release's own setuptools, through packaging/build-deb.sh)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
BUILD_DEB = ROOT / "packaging" / "build-deb.sh"


def test_license_is_an_spdx_expression() -> None:
    """PEP 639's form, which setuptools 77 and later read without a deprecation warning (the table
    form, {text = ...}, warns); the build system asks for such a setuptools."""
    doc = tomllib.loads(PYPROJECT.read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in doc["build-system"]["requires"]


def older_setuptools_rewrite(stage: Path, setuptools_major: int) -> None:
    """build-deb.sh's own step for a setuptools older than 77, run on a staging copy in ``stage``."""
    script = BUILD_DEB.read_text()
    match = re.search(r'^if \[ "\$setuptools_major" -lt 77 \]; then\n.*?^fi\n', script, re.M | re.S)
    assert match, "build-deb.sh no longer adapts pyproject.toml for an older setuptools"
    subprocess.run(
        ["bash", "-euc", f"stage={stage}; setuptools_major={setuptools_major}\n{match.group(0)}", "build-deb.sh"],
        check=True,
        timeout=30,
    )


def test_the_deb_build_gives_an_older_setuptools_the_same_licence(tmp_path: Path) -> None:
    """Built with Debian 12's setuptools (66), the staging copy holds the table form of the same licence
    and nothing else changes but the build requirement; setuptools 77 or later keeps the file as it is."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    older_setuptools_rewrite(tmp_path, 77)
    assert (tmp_path / "pyproject.toml").read_text() == PYPROJECT.read_text()
    older_setuptools_rewrite(tmp_path, 66)
    staged = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    original = tomllib.loads(PYPROJECT.read_text())
    assert staged["project"]["license"] == {"text": original["project"]["license"]}
    assert staged["build-system"]["requires"] == ["setuptools>=66"]
    staged["project"]["license"] = original["project"]["license"]
    staged["build-system"] = original["build-system"]
    assert staged == original


# older setuptools (Debian 12's 66) calls its [tool.setuptools] support beta: its warning, not ours
@pytest.mark.filterwarnings("ignore:Support for `\\[tool.setuptools\\]` in `pyproject.toml` is still")
def test_this_runtimes_setuptools_reads_the_file_the_deb_build_gives_it(tmp_path: Path) -> None:
    """The setuptools at hand (Debian 12's 66, or a newer one) validates pyproject.toml as build-deb.sh
    stages it for that setuptools."""
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import read_configuration

    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    older_setuptools_rewrite(tmp_path, int(setuptools.__version__.split(".")[0]))
    project = read_configuration(tmp_path / "pyproject.toml", expand=False)["project"]
    assert project["license"] in ("Apache-2.0", {"text": "Apache-2.0"})
