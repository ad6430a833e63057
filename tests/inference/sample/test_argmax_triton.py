"""Greedy argmax and the sampling race: the split Triton kernels vs their torch definitions, on a GPU or under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from inference.sample.argmax_triton import CHUNK, MIN_WIDTH, argmax_reference, race_reference  # noqa: E402
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


@needs_triton
def test_triton_race_matches_its_definition(kernels):
    check_race(kernels, 3 * CHUNK + 77)


@gpu_only
def test_gpu_race_matches_its_definition_at_gpt_oss_width(kernels):
    check_race(kernels, 201088)


def check_race(kernels, v: int) -> None:
    """The one-pass race equals `race_reference` given the uniforms `race_uniforms` says it
    draws: raced rows at several temperatures beside plain argmax rows, NaN and -inf included."""
    gen = torch.Generator().manual_seed(v)
    x = rows_in_wider_buffer(6, v, gen)
    x[2, : v // 2] = float("-inf")  # a raced row whose first half can never win
    x[4, 3] = float("nan")  # read as +inf: that row's token whatever the noise
    inv_temp = torch.tensor([1.0, 0.0, 0.5, 3.0, 1.0, 0.0], device=DEVICE)
    keys = torch.randint(0, 2**62, (6,), generator=gen).to(DEVICE)
    got = kernels.race_argmax_rows_triton(x, inv_temp, keys).cpu()
    uniforms = kernels.race_uniforms(keys, v)
    assert uniforms.shape == (6, v) and 0 < uniforms.min().item() and uniforms.max().item() < 1
    assert got.dtype == torch.int64
    assert got.tolist() == race_reference(x, inv_temp, uniforms).cpu().tolist()
    assert got[1].item() == x[1].argmax().item() and got[5].item() == x[5].argmax().item()
    assert got[2].item() >= v // 2 and got[4].item() == 3
    # Floors: row 0 may draw only its logits at or above 5 (a handful), row 3 its 3 best.
    floors = torch.full((6,), float("-inf"), device=DEVICE)
    floors[0] = 5.0
    floors[3] = (x[3].float() * 3.0).topk(3).values[-1]
    floored = kernels.race_argmax_rows_triton(x, inv_temp, keys, floors).cpu()
    assert floored.tolist() == race_reference(x, inv_temp, uniforms, floors).cpu().tolist()
    assert x[0, floored[0]].item() >= 5.0 and floored[3].item() in x[3].topk(3).indices.tolist()
    # The same keys draw the same tokens; other keys, other tokens (flat rows: any column can win).
    flat = torch.zeros(6, v, device=DEVICE)
    ones = torch.ones(6, device=DEVICE)
    again = kernels.race_argmax_rows_triton(flat, ones, keys).cpu().tolist()
    assert again == kernels.race_argmax_rows_triton(flat, ones, keys).cpu().tolist()
    assert again != kernels.race_argmax_rows_triton(flat, ones, keys + 1).cpu().tolist()


@needs_triton
def test_triton_race_no_rows_and_bad_strides(kernels):
    none = torch.zeros(0, device=DEVICE)
    no_keys = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert kernels.race_argmax_rows_triton(torch.zeros(0, MIN_WIDTH, device=DEVICE), none, no_keys).shape == (0,)
    with pytest.raises(ValueError, match="unit column stride"):
        x = torch.zeros(MIN_WIDTH, 2, device=DEVICE).t()
        kernels.race_argmax_rows_triton(
            x, torch.ones(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
        )


@needs_triton
def test_triton_race_uniforms_look_uniform_and_independent(kernels):
    """The race's noise: uniform over (0, 1) in each of 16 bins, uncorrelated between neighbouring
    columns and between rows with neighbouring keys, and the same for the same key."""
    keys = torch.tensor([5, 6, 1 << 40, 2**62 - 1], dtype=torch.int64, device=DEVICE)
    u = kernels.race_uniforms(keys, 4 * CHUNK).cpu().double()
    assert torch.equal(u[0], kernels.race_uniforms(keys[:1], 4 * CHUNK).cpu().double()[0])
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert ((counts - expected).abs() / expected).max() < 0.06  # 2,048 a bin: ~2.2% sd
    assert abs(u.mean().item() - 0.5) < 0.01

    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return (a * b).sum().item() / (a.norm() * b.norm()).item()

    # Every (row, column) its own Philox word: 32,768 draws on a grid of 2^23 repeat ~64 times.
    assert u.numel() - u.unique().numel() < 200
    assert abs(corr(u[:, :-1].flatten(), u[:, 1:].flatten())) < 0.03
    assert abs(corr(u[0], u[1])) < 0.06 and abs(corr(u[2], u[3])) < 0.06
