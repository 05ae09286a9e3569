"""The public ops launch on their tensors' CUDA device (Triton launches, events and stream
queries use the current device): ``treeops._checks.cuda_device``'s choice, checked on CPU with a
stand-in for a tensor on cuda:1."""

from contextlib import nullcontext
from types import SimpleNamespace

import torch

from treeops import _checks
from treeops._checks import cuda_device


def test_cpu_tensor_needs_no_switch():
    assert isinstance(cuda_device(torch.zeros(2)), nullcontext)


def test_switches_only_to_another_device(monkeypatch):
    entered = []

    class Recorder:
        def __init__(self, dev):
            self.dev = dev

        def __enter__(self):
            entered.append(self.dev)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(_checks, "_cuda_get_device", lambda: 0)  # the current device
    monkeypatch.setattr(torch.cuda, "device", Recorder)
    on1 = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1), get_device=lambda: 1)
    on0 = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), get_device=lambda: 0)
    with cuda_device(on0):
        pass
    assert entered == []  # already current
    with cuda_device(on1):
        pass
    assert entered == [torch.device("cuda", 1)]
