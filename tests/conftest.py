"""Test harness: interpreter mode, seeds, poisoned outputs, hypothesis profiles.

``TRITON_INTERPRET=1`` must be set before treeops (or triton) is imported: Triton decides at
decoration time whether a kernel is interpreted. On a machine with a GPU, set
``TREEOPS_GPU_TESTS=1`` to run the kernels compiled instead (the ``gpu`` marker's tests).
"""

import os

if os.environ.get("TREEOPS_GPU_TESTS") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# pytest-xdist workers share the machine's cores: each takes its share for the CPU references.
# With torch's default (every core in every worker) the acceptance GPU file had not finished
# after 280-290 s at -n 8 or -n 16 on a 16-core H100 host; with 2 threads a worker
# (bench/run_h200.sh) it takes 116 s at -n 8
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
settings.load_profile(os.environ.get("TREEOPS_HYPOTHESIS_PROFILE", "ci"))

_real_empty = torch.empty
_real_empty_like = torch.empty_like


@torch.no_grad()  # torch.compile allocates leaves that require grad; filling them is fine here
def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.numel():
        t.fill_(-0x5A5A5A5A if t.dtype in (torch.int32, torch.int64) else 0x5A)
    return t


def _poisoned_empty(*args, **kwargs):
    return _poison(_real_empty(*args, **kwargs))


def _poisoned_empty_like(*args, **kwargs):
    return _poison(_real_empty_like(*args, **kwargs))


@pytest.fixture(autouse=True)
def _seed_and_poison(monkeypatch):
    """Seed every RNG, and make ``torch.empty``/``empty_like`` return poisoned memory (NaN for
    floats, a sentinel for ints) so that an output element an op forgot to write fails a test."""
    torch.manual_seed(0)
    random.seed(0)
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", _poisoned_empty_like)
    yield


def pytest_configure(config):
    # The Triton 3.6 interpreter indexes with 1-element arrays (interpreter.py, ``__index__``),
    # which NumPy >= 1.25 deprecates: thousands of identical warnings about Triton, not treeops.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning:triton",
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and os.environ.get("TREEOPS_GPU_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and TREEOPS_GPU_TESTS=1 (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With ``TREEOPS_TEST_TIMES=path``, append each test's outcome and duration as it ends, so a
    GPU run cut short by its time limit still says which tests took the time."""
    path = os.environ.get("TREEOPS_TEST_TIMES")
    if path and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            r = report
            f.write(f"{r.duration:8.1f}s {r.when:5s} {r.outcome:7s} {r.nodeid}\n")
