"""pytest in bench/: the GPU benchmarks (``bench_*.py``) skip with a reason where they cannot
run; ``pair`` is the tiny random model pair the bench-tool tests decode with on the CPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the bench scripts import each other (harness, bench_graft)
    sys.path.insert(0, HERE)

from harness import needs_cuda  # noqa: E402


def pytest_collection_modifyitems(config, items):
    why = needs_cuda()
    if why is None:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        path = str(getattr(item, "path", item.fspath))
        if os.path.dirname(path) == HERE and os.path.basename(path).startswith("bench_"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def pair():
    """A target close to its bigram part and its bigram draft (bench_e2e's ``random_pair``)."""
    from bench_e2e import random_pair

    target, draft, _ = random_pair(torch.device("cpu"), small=True)
    return target, draft


@pytest.fixture(autouse=True, scope="module")
def _one_thread(request):
    """The bench-tool tests' tiny CPU matmuls: one thread (the benchmarks keep theirs)."""
    if not os.path.basename(str(request.module.__file__)).startswith("test_"):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
