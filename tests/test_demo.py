"""``treeops demo`` runs end to end on CPU and prints its table and a tree."""

import shutil
import subprocess
import sys
from pathlib import Path

from treeops.cli import main


def test_demo_runs(capsys):
    assert main(["demo", "--batch", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "draft widths" in out and "accepted/request" in out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 2
    assert "request " in out and "[0]" in out  # the drawn tree
    assert "tokens emitted per request" in out


def test_console_script_installed(tmp_path):
    # The script pip installed beside this interpreter (the venv need not be activated).
    beside = Path(sys.executable).parent / "treeops"
    exe = str(beside) if beside.exists() else shutil.which("treeops")
    assert exe is not None, "no treeops console script beside the interpreter or on PATH"
    out = subprocess.run([exe, "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and "demo" in out.stdout
