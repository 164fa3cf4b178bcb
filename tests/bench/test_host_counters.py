"""bench/host_counters.py: what counts as an operator call and as a would-be device sync."""

import pytest
import torch

from bench.host_counters import HostCounter

X = torch.arange(10.0)


@pytest.mark.parametrize("read", [
    lambda: X.tolist(), lambda: X[0].item(), lambda: bool(X[1] > 0), lambda: int(X[2]), lambda: float(X[3]),
    lambda: torch.nonzero(X > 3), lambda: X[X > 3], lambda: X.masked_select(X > 3),
    lambda: torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3])),
    lambda: X.clone().__setitem__(X > 3, 0.0),
], ids=["tolist", "item", "bool", "int", "float", "nonzero", "bool-index", "masked_select",
        "repeat_interleave", "bool-index_put"])
def test_each_value_read_is_one_sync(read):
    with HostCounter() as c:
        read()
    assert c.counts().num_syncs == 1


def test_ops_without_value_reads_are_not_syncs():
    with HostCounter() as c:
        y = X + 1
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]), output_size=6)
        torch.argmax(y)
    counts = c.counts()
    assert counts.num_syncs == 0
    assert counts.num_ops >= 4  # add, argmax and repeat_interleave's own ops


def test_iterating_a_tensor_reads_every_element():
    with HostCounter() as c:
        values = [int(v) for v in torch.tensor([4, 5, 6])]
    assert values == [4, 5, 6] and c.counts().num_syncs == 3
    assert dict(c.counts().sync_sites) == {"Tensor.__int__": 3}
