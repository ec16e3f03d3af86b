"""The wheel declares what the code needs, so `pipx install .` gives an
`apiary` that runs: a distribution for every module the runtime packages
import, in ranges that hold the versions pinned (and tested) in
requirements.txt, which also pins everything those pull in.

The wheel is built here, offline: `pip wheel --no-build-isolation` with the
setuptools that requirements-test.txt pins, from a copy of the sources (a
build in the worktree would leave build/ and *.egg-info behind)."""

import ast
import email
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import apiary_site

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("apiary_site", "jobqueue", "workers", "workflows")
# Needed at run time, but never imported by name in the packages.
INDIRECT = {
    "axes": "settings.INSTALLED_APPS",
    "psycopg_pool": "settings.PG_POOL: Django's PostgreSQL pool in the listener",
    "httptools": "uvicorn's httptools protocol, which apiary_site.listener subclasses",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (built,) = tmp.glob("apiary-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def _metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


def _requires(wheel: zipfile.ZipFile) -> list[Requirement]:
    return [Requirement(line) for line in _metadata(wheel).get_all("Requires-Dist") or []]


def _imported_modules() -> set[str]:
    """Top-level modules outside the standard library that the runtime packages import."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - set(PACKAGES)


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not an exact pin"
            pins[canonicalize_name(requirement.name)] = spec.version
    return pins


def test_the_wheel_requires_a_distribution_for_every_module_the_runtime_imports(wheel):
    required = {canonicalize_name(r.name) for r in _requires(wheel)}
    providers = importlib.metadata.packages_distributions()
    modules = _imported_modules() | set(INDIRECT)
    assert {"django", "rest_framework", "yaml", "requests", "gunicorn"} <= modules  # the scan sees imports
    missing = {
        module: providers.get(module)
        for module in sorted(modules)
        if not any(canonicalize_name(d) in required for d in providers.get(module, ()))
    }
    assert not missing, f"imported but not in the wheel's Requires-Dist: {missing}"


def test_every_requirement_is_a_range_that_holds_its_pin_in_requirements_txt(wheel):
    pins = _pins(ROOT / "requirements.txt")
    for requirement in _requires(wheel):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not pinned in requirements.txt"
        assert requirement.specifier.contains(pins[name]), f"{requirement} excludes the pinned {pins[name]}"
        assert not any(s.operator == "==" for s in requirement.specifier), f"{requirement}: a range, not a pin"


def test_requirements_txt_pins_everything_its_pins_pull_in():
    pins = _pins(ROOT / "requirements.txt")
    extras = {}  # what each pin asks for (psycopg[binary]): its extra's dependencies count too
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            extras[canonicalize_name(requirement.name)] = requirement.extras
    unpinned = {}
    for name in pins:
        for text in importlib.metadata.distribution(name).requires or []:
            dependency = Requirement(text)
            wanted = extras.get(name) or {""}
            if dependency.marker and not any(dependency.marker.evaluate({"extra": extra}) for extra in wanted):
                continue
            if canonicalize_name(dependency.name) not in pins:
                unpinned[dependency.name] = name
    assert not unpinned, f"pulled in but not pinned in requirements.txt (dependency: by): {unpinned}"


def test_the_wheel_holds_every_file_of_the_packages_the_version_and_the_command(wheel):
    names = set(wheel.namelist())
    files = {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    assert "apiary_site/management/commands/runapiary.py" in files
    assert not files - names, f"missing from the wheel: {sorted(files - names)}"
    assert _metadata(wheel)["Version"] == apiary_site.__version__
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "apiary = apiary_site.cli:main" in wheel.read(entry_points).decode()
