"""kernels/ and reference/ install as treeops.kernels / treeops.reference, never top-level.

Checked in subprocesses started from a temporary directory (``python -m pytest`` puts the repo
root on sys.path, which would hide a wrong layout), for an editable install and for a built wheel,
each installed into a fresh virtual environment. The fresh environments borrow torch/triton from
the running interpreter through a ``.pth`` file rather than installing them again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib.util, sys, pathlib
import treeops, treeops.kernels, treeops.reference, treeops.decoder
for top in ("kernels", "reference"):
    assert importlib.util.find_spec(top) is None, f"{top} is importable as a top-level package"
print(pathlib.Path(treeops.__file__).resolve())
print(pathlib.Path(treeops.kernels.__file__).resolve())
print(pathlib.Path(treeops.reference.__file__).resolve())
"""


def _fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    py = path / "bin" / "python"
    site = subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    # torch, triton, numpy come from the interpreter running the tests (not reinstalled).
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "_treeops_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return py


def _probe(py: Path, cwd: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(py), "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _pip(py: Path, *args: str) -> None:
    out = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", *args], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_editable_install_maps_subpackages(tmp_path):
    py = _fresh_venv(tmp_path / "venv")
    _pip(py, "-e", str(REPO))
    treeops_file, kernels_file, reference_file = _probe(py, tmp_path)
    assert Path(treeops_file) == REPO / "treeops" / "__init__.py"
    assert Path(kernels_file) == REPO / "kernels" / "__init__.py"
    assert Path(reference_file) == REPO / "reference" / "__init__.py"


@pytest.mark.slow
def test_wheel_install_maps_subpackages(tmp_path):
    wheels = tmp_path / "wheels"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = wheels.glob("treeops-*.whl")
    py = _fresh_venv(tmp_path / "venv")
    _pip(py, str(wheel))
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    ).resolve()
    files = [Path(p) for p in _probe(py, tmp_path)]
    assert files == [
        site / "treeops" / "__init__.py",
        site / "treeops" / "kernels" / "__init__.py",
        site / "treeops" / "reference" / "__init__.py",
    ]
    assert not (site / "kernels").exists() and not (site / "reference").exists()
    assert (site / "treeops" / "py.typed").exists()


def test_console_script_declared():
    text = (REPO / "pyproject.toml").read_text()
    assert '[project.scripts]\ntreeops = "treeops.cli:main"' in text
