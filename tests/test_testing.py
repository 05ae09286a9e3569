"""treeops.testing.NoHostSync: what it refuses, what it lets through, its regions."""

import pytest
import torch

from treeops.testing import NoHostSync

x = torch.arange(8)
m = x > 3

REFUSED = {
    "item": lambda: x[0].item(),
    "int": lambda: int(x.sum()),
    "bool": lambda: bool((x > 2).any()),
    "float": lambda: float(x.float().mean()),
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "nonzero": lambda: x.nonzero(),
    "mask read": lambda: x[m],
    "mask write": lambda: x.clone().__setitem__(m, 0),
    "masked_select": lambda: torch.masked_select(x, m),
    "unique": lambda: torch.unique(x),
    "unique_consecutive": lambda: torch.unique_consecutive(x),
    "repeat_interleave": lambda: torch.repeat_interleave(x, x),
    "bincount": lambda: torch.bincount(x),
    "equal": lambda: torch.equal(x, x),
    "allclose": lambda: torch.allclose(x.float(), x.float()),
    "host data": lambda: torch.tensor([1, 2, 3]),
}

ALLOWED = {
    "where": lambda: torch.where(m, x, 0),
    "gather": lambda: x.gather(0, torch.zeros(3, dtype=torch.long)),
    "index by int tensor": lambda: x[torch.arange(3)],
    "scalar write": lambda: x.clone().__setitem__(0, 5),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(x, x, output_size=28),
    "cumsum/topk/sort": lambda: (x.cumsum(0), x.float().topk(3), x.sort()),
    "any without reading it": lambda: (x > 2).any(),
    "new full/zeros/arange": lambda: (torch.full((3,), 7), torch.zeros(2), torch.arange(4)),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses(name):
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        REFUSED[name]()


@pytest.mark.parametrize("name", list(ALLOWED))
def test_allows(name):
    with NoHostSync() as check:
        ALLOWED[name]()
    assert check.ops_checked > 0


def test_regions_and_opaque():
    check = NoHostSync(only_regions=True)
    with check:
        assert int(x.sum()) == 28  # outside every region: not checked
        with pytest.raises(AssertionError):
            check.region(lambda: int(x.sum()))()
        # opaque inside a region: not checked
        assert check.region(check.opaque(lambda: x.tolist()))() == list(range(8))
    assert x.tolist() == list(range(8))  # Tensor.tolist restored on exit
