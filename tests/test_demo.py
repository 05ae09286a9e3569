"""``treeops demo`` runs end to end on CPU: the synthetic walk through every op (cheap), and the
trained-pair demo on the ``micro`` preset (seconds of training, every policy checked against
greedy decoding). The command line refuses bad arguments with one line naming the flag."""

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


# ------------------------------------------------------------------ command-line user errors
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["demo", "--synthetic", "--steps", "0"], "--steps"),
        (["demo", "--batch", "0"], "--batch"),
        (["demo", "--new-tokens", "0"], "--new-tokens"),
        (["demo", "--preset", "huge"], "--preset"),
        (["decode", "--policy", "bogus"], "--policy"),
        (["decode", "--policy", "chain", "--policy", "medusa"], "--policy"),
        (["decode", "--batch", "0"], "--batch"),
        (["decode", "--batch", "two"], "--batch"),
        (["decode", "--new-tokens", "-3"], "--new-tokens"),
        (["decode", "--temperature", "-1"], "--temperature"),
        (["decode", "--temperature", "nan"], "--temperature"),
        (["decode", "--model", "{missing}"], "--model"),
        (["decode", "--model", "{bad_config}"], "--model"),
        (["demo", "--cache-dir", "{a_file}"], "--cache-dir"),
    ],
)
def test_cli_user_error_is_one_line_naming_the_flag(argv, flag, capsys, tmp_path, monkeypatch):
    """A bad argument: exit status 2, nothing on stdout (no table header), one ``error:`` line on
    stderr naming the flag, no traceback, and no work done first (training or decoding would
    fail this test)."""
    import treeops.decoder.cli as decoder_cli
    import treeops.demo as demo

    def no_work(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(demo, "train_pair", no_work)
    monkeypatch.setattr(decoder_cli, "Decoder", no_work)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "file").write_text("")
    paths = {
        "missing": tmp_path / "none",
        "bad_config": tmp_path / "bad",
        "a_file": tmp_path / "file",
    }
    argv = [a.format(**paths) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    errors = [line for line in out.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {flag}" in errors[0], out.err
    assert "Traceback" not in out.err
    assert out.err.splitlines()[-1] == errors[0]  # the message is the last line, in one line


def test_cli_bad_policy_runs_nothing_in_a_subprocess(tmp_path):
    """The console command itself (not only ``main``): exit status 2 and a one-line error."""
    out = subprocess.run(
        [sys.executable, "-m", "treeops", "decode", "--policy", "bogus"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines()[-1].startswith("treeops decode: error: argument --policy")
    assert "Traceback" not in out.stderr


def test_api_arguments_are_checked_before_work(monkeypatch):
    """The Python entry points refuse bad sizes with a ValueError naming the argument, before
    any training (``run_demo``) or model building (``run_decode``)."""
    import treeops.decoder.cli as decoder_cli
    import treeops.demo as demo
    from treeops.decoder.cli import run_decode
    from treeops.demo import run_demo, run_synthetic_demo

    def no_work(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(demo, "train_pair", no_work)
    monkeypatch.setattr(decoder_cli, "Target", no_work)
    for call, name in (
        (lambda: run_synthetic_demo(steps=0), "steps"),
        (lambda: run_synthetic_demo(batch=0), "batch"),
        (lambda: run_demo(batch=0), "batch"),
        (lambda: run_demo(new_tokens=0), "new_tokens"),
        (lambda: run_demo(preset="huge"), "preset"),
        (lambda: run_decode(batch=0), "batch"),
        (lambda: run_decode(new_tokens=0), "new_tokens"),
        (lambda: run_decode(policies=["bogus"]), "policy"),
        (lambda: run_decode(temperature=-1.0), "temperature"),
    ):
        with pytest.raises(ValueError, match=name):
            call()


def test_synthetic_demo_one_step(capsys):
    assert main(["demo", "--synthetic", "--batch", "1", "--steps", "1"]) == 0
    assert "tokens emitted per request" in capsys.readouterr().out


def test_help_is_plain_text_with_defaults_and_choices(capsys):
    from treeops.cli import POLICY_NAMES
    from treeops.decoder import POLICIES

    assert POLICY_NAMES == POLICIES
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    top = capsys.readouterr().out
    assert "demo" in top and "decode" in top
    for markup in ("``", ":func:", ":class:", ".. "):
        assert markup not in top
    for cmd, wants in (
        ("decode", ["(default: 3)", "(default: 16)", "{autoregressive,chain,EagleStatic,Cast,"
                    "CastGraft}", "(default: 0.0)"]),
        ("demo", ["(default: 4)", "(default: 32)", "{tiny,micro}", "(default: tiny)"]),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text
        for want in wants:
            assert want in " ".join(text.split()), (cmd, want)
