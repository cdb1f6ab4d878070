"""What a user installs: the version, the declared dependency range against what the suite ran on, the install
commands the docs and messages give."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import token_mean
from token_mean._versions import check_versions

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_distributions() -> None:
    assert token_mean.__version__ == importlib.metadata.version("lightning-token-mean")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert token_mean.__version__ == project["version"]
    assert f"## {project['version']}" in (ROOT / "CHANGELOG.md").read_text()


def test_declared_range_holds_the_tested_versions() -> None:
    """Every runtime dependency is bounded above, and constraints.txt's pin (what the suite ran on) lies inside."""
    pins = {
        Requirement(line).name: Version(str(next(iter(Requirement(line).specifier))).lstrip("="))
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"]:
        requirement = Requirement(text)
        assert requirement.name in pins, requirement
        assert pins[requirement.name] in requirement.specifier, (requirement, pins[requirement.name])
        if requirement.name in ("torch", "lightning"):
            assert any(spec.operator == "<" for spec in requirement.specifier), f"{requirement}: no upper bound"
    readme = (ROOT / "README.md").read_text()
    assert f"torch=={pins['torch']}" in readme and f"lightning=={pins['lightning']}" in readme


def test_no_install_command_names_an_unpublished_package() -> None:
    """`lightning-token-mean` is not on a package index: the docs and messages install from a clone or a wheel."""
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src" / "token_mean").glob("*.py")]
    unpublished = re.compile(r"pip install '?lightning-token-mean")
    offenders = [str(path.relative_to(ROOT)) for path in texts if unpublished.search(path.read_text())]
    assert offenders == []


@pytest.mark.slow
def test_import_registers_the_strategy_names() -> None:
    """README's quick start: `import token_mean` registers "ddp_token_mean"; without it Lightning refuses the name."""
    make = "import lightning.pytorch as pl; pl.Trainer(strategy='ddp_token_mean', accelerator='cpu', devices=1)"
    processes = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for code in (make, "import token_mean; " + make)]  # side by side
    try:
        (_, without), (_, with_import) = (process.communicate(timeout=120) for process in processes)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert processes[0].returncode != 0 and "invalid strategy name" in without, without[-2000:]
    assert processes[1].returncode == 0, with_import[-2000:]


# ---- the declared range, checked at import ----

DECLARED = ["torch<2.16,>=2.6", "lightning<2.7,>=2.6.0", "torchmetrics<1.10,>=1.5", 'matplotlib>=3.7; extra == "plot"']
IN_RANGE = {"torch": "2.6.0+cu124", "lightning": "2.6.0", "torchmetrics": "1.5.0", "matplotlib": "3.1"}


def test_the_installed_versions_lie_in_the_declared_range() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_versions()  # this environment's own, read from the installed metadata as `import token_mean` does
        check_versions(DECLARED, IN_RANGE.__getitem__)  # the floors themselves; an extra's requirement is not checked


@pytest.mark.parametrize(
    ("name", "found"), [("torch", "2.5.1+cu124"), ("lightning", "2.5.6"), ("torchmetrics", "1.4.3")]
)
def test_an_older_dependency_is_refused_with_the_fix(name: str, found: str) -> None:
    requirement = next(text for text in DECLARED if text.startswith(name))
    with pytest.raises(ImportError, match=rf"needs {requirement} .* has {name} {re.escape(found)}\. Upgrade it, e\.g\."
                       rf" `pip install '{requirement}'`"):
        check_versions(DECLARED, {**IN_RANGE, name: found}.__getitem__)


@pytest.mark.parametrize(("name", "found"), [("torch", "2.16.0"), ("torch", "2.16.0.dev20261201+cpu"),
                                             ("lightning", "2.7.0rc1"), ("torchmetrics", "1.10.0")])
def test_a_newer_dependency_warns_once(name: str, found: str) -> None:
    with pytest.warns(UserWarning, match=rf"{name} {re.escape(found)} is newer and untested") as caught:
        check_versions(DECLARED, {**IN_RANGE, name: found}.__getitem__)
    assert len(caught) == 1


def test_the_compat_ends_are_the_declared_floors() -> None:
    """`.ci/compat` runs the suite at the floor of every declared range, and at a torch inside it."""
    script = (ROOT / ".ci" / "compat").read_text()
    ends = {end: dict(pin.split("==") for pin in re.search(rf'^{end}_PINS="(.*)"$', script, re.M)[1].split())
            for end in ("OLDEST", "NEWEST")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in map(Requirement, project["dependencies"]):
        floor = next(Version(spec.version) for spec in requirement.specifier if spec.operator == ">=")
        assert Version(ends["OLDEST"][requirement.name]) == floor, requirement
        assert Version(ends["NEWEST"][requirement.name]) in requirement.specifier, requirement
