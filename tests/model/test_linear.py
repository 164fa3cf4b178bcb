"""The model's linear layers: oneDNN for float32 CPU products of 16+ rows (MKL's sgemm takes its AVX2
path on AMD CPUs), F.linear otherwise; the same values up to float reassociation, deterministic, and
every projection of a built model goes through it."""

from __future__ import annotations

import torch
from torch import nn

from workers.model.linear import ONEDNN_MIN_ROWS, Linear, linear, uses_onednn


def _inputs(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)


def test_linear_equals_f_linear_and_takes_onednn_only_where_it_should():
    with torch.inference_mode():
        for rows in (1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 300):
            x, w, b = _inputs(rows)
            torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)
            assert uses_onednn(x, w) == (rows >= ONEDNN_MIN_ROWS and torch.backends.mkldnn.is_available())
        x, w, _ = _inputs(64)
        assert not uses_onednn(x.bfloat16(), w.bfloat16())  # float32 only
        assert uses_onednn(x[:, None].expand(64, 2, 96), w)  # leading dims count as rows
    x, w, _ = _inputs(64)
    assert not uses_onednn(x, w)  # autograd on (training): oneDNN's op has no backward


def test_onednn_rows_are_deterministic_and_do_not_depend_on_the_rest_of_the_batch():
    """A request's rows give the same bits whether 16 or 300 rows are multiplied with them: what keeps
    a sequence's output independent of its batch (the concurrency bench checks every level's outputs)."""
    x, w, b = _inputs(300, seed=1)
    with torch.inference_mode():
        full = linear(x, w, b)
        assert torch.equal(full, linear(x, w, b))
        assert torch.equal(linear(x[:ONEDNN_MIN_ROWS], w, b), full[:ONEDNN_MIN_ROWS])
        assert torch.equal(linear(x[100:164], w, b), full[100:164])


def test_every_projection_of_a_built_model_is_a_linear(tiny_model):
    plain = [name for name, m in tiny_model.named_modules() if type(m) is nn.Linear]
    ours = [name for name, m in tiny_model.named_modules() if isinstance(m, Linear)]
    assert not plain and len(ours) >= 20


def test_the_module_routes_many_rows_to_onednn_and_few_to_f_linear():
    """Bit for bit (the two libraries round differently): a Linear that always took F.linear would lose
    the speed silently, one that always took oneDNN would slow single-sequence steps."""
    torch.manual_seed(0)
    layer = Linear(512, 256)  # a long enough reduction that the two libraries' sums differ
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        few, many = torch.randn(ONEDNN_MIN_ROWS - 1, 512, generator=g), torch.randn(300, 512, generator=g)
        assert torch.equal(layer(few), torch.nn.functional.linear(few, layer.weight, layer.bias))
        if torch.backends.mkldnn.is_available():
            want = torch.ops.mkldnn._linear_pointwise(many, layer.weight, layer.bias, "none", [], "")
            assert torch.equal(layer(many), want)
            assert not torch.equal(want, torch.nn.functional.linear(many, layer.weight, layer.bias))
