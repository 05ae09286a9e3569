"""``treeops demo`` runs end to end on CPU: the synthetic walk through every op (cheap), and the
trained-pair demo on the ``micro`` preset (seconds of training, every policy checked against
greedy decoding)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treeops.cli import main


def test_synthetic_demo_runs(capsys):
    assert main(["demo", "--synthetic", "--batch", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "draft widths" in out and "accepted/request" in out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 2
    assert "request " in out and "[0]" in out  # the drawn tree
    assert "tokens emitted per request" in out


def test_trained_pair_demo_micro(capsys, tmp_path):
    pytest.importorskip("tokenizers")
    threads = torch.get_num_threads()
    argv = ["demo", "--preset", "micro", "--cache-dir", str(tmp_path), "--batch", "2"]
    try:
        torch.set_num_threads(1)
        assert main([*argv, "--new-tokens", "6"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for policy in ["autoregressive", "chain", "EagleStatic", "Cast", "CastGraft"]:
        row = next(line for line in out.splitlines() if line.startswith(policy + " "))
        assert row.rstrip().endswith("yes"), row
    assert "verification tree" in out and "[0]" in out
    assert "equals autoregressive greedy decoding" in out
    assert (tmp_path / "pair_config.json").exists()


def test_console_script_installed(tmp_path):
    # The script pip installed beside this interpreter (the venv need not be activated).
    beside = Path(sys.executable).parent / "treeops"
    exe = str(beside) if beside.exists() else shutil.which("treeops")
    assert exe is not None, "no treeops console script beside the interpreter or on PATH"
    out = subprocess.run([exe, "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and "demo" in out.stdout
