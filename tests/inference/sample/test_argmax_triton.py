"""Greedy argmax: the split Triton kernels vs `torch.argmax`, on a GPU or under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from inference.sample.argmax_triton import CHUNK, MIN_WIDTH, argmax_reference  # noqa: E402
from tests.triton_interpreter import (  # noqa: E402  (first: sets TRITON_INTERPRET on CPU)
    DEVICE,
    fresh_process_only,
    gpu_only,
    kernel_module,
    needs_triton,
    run_in_fresh_interpreter,
)


@pytest.fixture(scope="module")
def kernels():
    return kernel_module("inference.sample.argmax_triton", "_argmax_partial_kernel")


@fresh_process_only
def test_triton_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


def rows_in_wider_buffer(n: int, v: int, gen: torch.Generator) -> torch.Tensor:
    """Random [n, v] logits as a view whose row stride is v + 7; the columns past v hold +inf,
    so a kernel reading past its row's end picks them."""
    store = torch.full((n, v + 7), float("inf"))
    store[:, :v] = torch.randn(n, v, generator=gen) * 3
    return store.to(DEVICE)[:, :v]


@needs_triton
@pytest.mark.parametrize("v", [5 * CHUNK, 3 * CHUNK + 77, 201088])
def test_triton_argmax_matches_torch(kernels, v):
    gen = torch.Generator().manual_seed(v)
    x = rows_in_wider_buffer(5, v, gen)
    # Row 1: its maximum three times, in different chunks and twice in one: the first wins.
    x[1, :] = 0.0
    x[1, [CHUNK + 5, CHUNK + 9, v - 1]] = 7.0
    # Row 2: the maximum in the last, partial chunk. Row 3: every value -inf.
    x[2, v - 2] = 100.0
    x[3, :] = float("-inf")
    # Row 4: a NaN (read as +inf) after an ordinary maximum.
    x[4, 10] = 50.0
    x[4, 2 * CHUNK + 1] = float("nan")
    got = kernels.argmax_rows_triton(x).cpu()
    expected = argmax_reference(x).cpu()
    assert got.dtype == torch.int64
    assert got.tolist() == expected.tolist()
    assert got[1].item() == CHUNK + 5 and got[2].item() == v - 2 and got[3].item() == 0
    assert got[4].item() == 2 * CHUNK + 1


@needs_triton
def test_triton_argmax_no_rows_and_bad_strides(kernels):
    assert kernels.argmax_rows_triton(torch.zeros(0, MIN_WIDTH, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="unit column stride"):
        kernels.argmax_rows_triton(torch.zeros(MIN_WIDTH, 2, device=DEVICE).t())


def test_dispatch_keeps_cpu_and_narrow_rows_on_torch(monkeypatch):
    import inference.sample.argmax_triton as module

    def refuse(x):
        raise AssertionError("the Triton path was taken")

    monkeypatch.setattr(module, "argmax_rows_triton", refuse)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, MIN_WIDTH, generator=gen)
    assert module.argmax_rows(x).tolist() == x.argmax(-1).tolist()  # CPU
    if torch.cuda.is_available():
        narrow = torch.randn(2, 100, generator=gen).cuda()
        assert module.argmax_rows(narrow).tolist() == narrow.argmax(-1).tolist()


@gpu_only
def test_gpu_dispatch_takes_the_kernels_for_gpt_oss_rows(monkeypatch):
    import inference.sample.argmax_triton as module

    calls = []
    real = module.argmax_rows_triton
    monkeypatch.setattr(module, "argmax_rows_triton", lambda x: calls.append(x.shape) or real(x))
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 201088, generator=gen) * 4).cuda()
    assert torch.equal(module.argmax_rows(x), x.argmax(-1))
    assert calls == [(64, 201088)]
