"""The wheel, as a package index would install it: every module, the built-in spaces as package data, one
version; and the installed package finds its spaces from outside the checkout."""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import autotune

REPO = Path(__file__).resolve().parent.parent
# What the build reads. It runs on a copy, so that it leaves no build/ or egg-info in the checkout.
SOURCES = ("pyproject.toml", "README.md", "autotune", "search_spaces")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    # No build isolation: the dev extra installs the build backend, so this needs no package index.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(root / "dist")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (root / "dist").glob("autotune-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into a folder of its own (its dependencies come from this environment)."""
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def run_installed(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # Only the installed copy on the path: not the checkout (PYTHONPATH in a development shell).
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "400"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_wheel_holds_every_module_and_the_builtin_spaces(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "autotune").rglob("*.py")}
    assert modules - names == set()
    spaces = sorted((REPO / "search_spaces").glob("*.yaml"))
    assert spaces
    with zipfile.ZipFile(wheel) as z:
        for path in spaces:
            assert z.read(f"autotune/search_spaces/{path.name}") == path.read_bytes(), path.name


def test_the_wheel_version_is_the_package_version(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        version = email.parser.Parser().parsestr(z.read(metadata).decode())["Version"]
    assert version == autotune.__version__
    assert wheel.name.startswith(f"autotune-{autotune.__version__}-")


def test_the_installed_package_finds_its_spaces_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    probe = run_installed(installed, "-c", "import autotune; from autotune.search._space import SPACES_DIR; "
                                           "print(autotune.__file__); print(SPACES_DIR)", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    package_file, spaces_dir = probe.stdout.split()
    assert Path(package_file).is_relative_to(installed)
    assert Path(spaces_dir) == installed / "autotune" / "search_spaces"

    listed = run_installed(installed, "-m", "autotune", "spaces", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    ok = [line for line in listed.stdout.splitlines() if line.startswith("ok")]
    assert len(ok) == len(list((REPO / "search_spaces").glob("*.yaml")))
    assert all(str(installed / "autotune" / "search_spaces") in line for line in ok)
    version = run_installed(installed, "-m", "autotune", "--version", cwd=tmp_path)
    assert version.stdout.strip() == f"autotune {autotune.__version__}", version.stdout + version.stderr


def test_spaces_with_no_builtin_space_found_is_a_one_line_error(installed: Path, tmp_path: Path) -> None:
    broken = tmp_path / "site"
    shutil.copytree(installed, broken)
    for path in (broken / "autotune" / "search_spaces").glob("*.yaml"):
        path.unlink()
    proc = run_installed(broken, "-m", "autotune", "spaces", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: no built-in search spaces"), proc.stderr
    assert proc.stdout == ""


def test_python_m_autotune_above_a_clone_named_autotune_says_so_in_one_line(wheel: Path, tmp_path: Path) -> None:
    """A clone of the repository in a folder named ``autotune``, Python started in its parent: ``python -m
    autotune`` takes the clone's folder for the package and runs the clone's root ``__main__.py``, which says
    so in one line (before: a traceback, ``cannot import name '__version__' from 'autotune'``). The wheel
    leaves that file out."""
    clone = tmp_path / "autotune"
    clone.mkdir()
    shutil.copy2(REPO / "__main__.py", clone / "__main__.py")
    proc = subprocess.run([sys.executable, "-m", "autotune", "--version"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "is a clone of autotune's repository" in proc.stderr, proc.stderr
    assert "__main__.py" not in zipfile.ZipFile(wheel).namelist()
