"""bench/stream_probe.py's plain row-stat kernel: its chunks' partials merge to each row's max and
sum of exp (the interpreter on CPU; tests/conftest.py sets it for a whole run)."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip(
        "needs TRITON_INTERPRET=1 (set by tests/conftest.py) or a GPU", allow_module_level=True
    )

import stream_probe  # noqa: E402


@pytest.mark.parametrize("split,block", [(1, 512), (4, 512), (3, 1024)])
def test_partials_merge_to_the_rows_max_and_sum(split, block):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(split)
    x = (torch.randn(2, 3, 3000, generator=g) * 4).to(torch.bfloat16).to(dev)
    x[0, 1, :1200] = -float("inf")  # a chunk with no finite logit
    m = torch.empty(6 * split, device=dev)
    s = torch.empty_like(m)
    stream_probe.run_stat1d(x, split, block, 1, 1, m, s)
    pm, ps = m.view(6, split).cpu(), s.view(6, split).cpu()
    mx = pm.max(1).values
    total = (ps * torch.exp(pm - mx[:, None]).nan_to_num(0.0)).sum(1)
    rows = x.float().view(6, 3000).cpu()
    assert torch.equal(mx, rows.max(1).values)
    torch.testing.assert_close(total, torch.exp(rows - mx[:, None]).sum(1), rtol=1e-5, atol=0)
