"""kernel_limits' parsing of ncu's CSV and its command line (CPU; the profiling needs a GPU)."""

import kernel_limits as K
import pytest

_HEAD = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
         "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
         "Metric Value")  # fmt: skip
_SOL, _LAUNCH = "GPU Speed Of Light Throughput", "Launch Statistics"
_ROWS = [
    ("0", "_stream_kernel(int)", _SOL, "Duration", "nsecond", "6,120"),
    ("0", "_stream_kernel(int)", _SOL, "DRAM Throughput", "%", "81.0"),
    ("0", "_stream_kernel(int)", _SOL, "Compute (SM) Throughput", "%", "35.5"),
    ("0", "_stream_kernel(int)", "Occupancy", "Achieved Occupancy", "%", "40.0"),
    ("0", "_stream_kernel(int)", _LAUNCH, "Registers Per Thread", "register/thread", "62"),
    ("0", "_stream_kernel(int)", _LAUNCH, "Shared Memory Configuration Size", "byte", "0"),
    ("1", "_expand_kernel(int)", _SOL, "DRAM Throughput", "%", "2.0"),
    ("1", "_expand_kernel(int)", _SOL, "Compute (SM) Throughput", "%", "1.5"),
]


def _csv() -> str:
    """ncu's --csv --page details layout: a log line, the header, a row per (kernel, metric)."""
    q = lambda xs: ",".join(f'"{x}"' for x in xs)  # noqa: E731
    launch = ("(32,1,1)", "(630,1,1)", "0", "9.0")
    rows = [q((i, "1", "python3", "h", k, "1", "7", *launch, s, m, u, v))
            for i, k, s, m, u, v in _ROWS]  # fmt: skip
    return "\n".join(["==PROF== Connected to process 1", q(_HEAD), *rows]) + "\n"


def test_parse_keeps_the_counters_per_kernel_in_launch_order():
    ks = K.parse(_csv())
    assert [k["kernel"] for k in ks] == ["_stream_kernel", "_expand_kernel"]
    first = ks[0]
    assert first["duration"] == 6120.0 and first["duration_unit"] == "nsecond"
    assert first["dram_pct"] == 81.0 and first["registers"] == 62.0
    assert first["achieved_occupancy_pct"] == 40.0
    assert "Shared Memory Configuration Size" not in str(first)  # only the kept counters
    assert first["limiter"] == "DRAM bandwidth"
    assert ks[1]["limiter"].startswith("latency")


def test_parse_without_ncu_output_raises():
    with pytest.raises(RuntimeError, match="no ncu CSV"):
        K.parse("==ERROR== profiling failed")


def test_command_line():
    assert K.main(["--list"]) == 0
    with pytest.raises(SystemExit):
        K.main(["--out", "/tmp/x", "--cases", "no_such_case"])


def test_summarise_adds_stall_samples_per_kernel_and_line(tmp_path):
    """ncu's --page source --print-source cuda,sass layout: a block per (file, kernel), a line row
    carrying that line's samples, its SASS rows under it (not counted again), "-" for a line
    without instructions."""
    head = '"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","# Samples"'
    text = "\n".join([
        '"File Path","/x/build_tree_vocab.py"', '"Function Name","_stream_kernel"', head,
        '"51","return tl.load(p)","-","-","40","40"', '"","","0x10","LDG.E R1","40","40"',
        '"52","# a comment","-","-","-","-"',
        '"File Path","/x/standard.py"', '"Function Name","_stream_kernel"', head,
        '"170","return core.maximum(a, b)","-","-","7","7"',
        '"File Path","/x/build_tree_vocab.py"', '"Function Name","_expand_kernel"', head,
        '"51","return tl.load(p)","-","-","3","3"',
    ])  # fmt: skip
    path = tmp_path / "case_source.csv"
    path.write_text(text + "\n")
    got = K.summarise(str(path))
    assert [(n, w) for n, w, _ in got] == [
        (40.0, "_stream_kernel build_tree_vocab.py:51"),
        (7.0, "_stream_kernel standard.py:170"),
        (3.0, "_expand_kernel build_tree_vocab.py:51"),
    ]
    assert got[0][2] == "return tl.load(p)"
