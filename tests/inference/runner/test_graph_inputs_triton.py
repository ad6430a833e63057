"""Filling a captured decode graph's inputs: the one-launch Triton kernel vs the copy-per-buffer
reference, on a GPU or under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from inference.runner.graph_inputs_triton import (  # noqa: E402
    BLOCK_P,
    KINDS,
    GraphInputs,
    StepValues,
    fill_graph_inputs_reference,
)
from tests.triton_interpreter import (  # noqa: E402  (first: sets TRITON_INTERPRET on CPU)
    DEVICE,
    fresh_process_only,
    kernel_module,
    needs_triton,
    run_in_fresh_interpreter,
)


@pytest.fixture(scope="module")
def kernels():
    return kernel_module("inference.runner.graph_inputs_triton", "_fill_kernel")


@fresh_process_only
def test_triton_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


def junk_buffers(b: int, q: int, p: int, gen: torch.Generator) -> GraphInputs:
    """Graph buffers full of values no step writes, as after some earlier, larger step."""

    def rand(*shape, dtype):
        return torch.randint(1000, 2000, shape, generator=gen).to(dtype).to(DEVICE)

    return GraphInputs(
        input_ids=rand(b * q, dtype=torch.long),
        positions=rand(b * q, dtype=torch.long),
        slots={k: rand(b * q, dtype=torch.long) for k in KINDS},
        context_lens=rand(b, dtype=torch.int32),
        block_tables={k: rand(b, p, dtype=torch.int32) for k in KINDS},
        valid_tokens=rand(1, dtype=torch.int32),
    )


def step_values(n: int, q: int, w: int, gen: torch.Generator, previous: int = 0) -> StepValues:
    t = n * q
    tables = {}
    for k in KINDS:  # packed rows of width w (row stride w + 3 here: a view, as the packer's are)
        store = torch.randint(0, 500, (n, w + 3), generator=gen, dtype=torch.int32)
        tables[k] = store.to(DEVICE)[:, :w]
    ids = torch.randint(0, previous, (t,), generator=gen) if previous else torch.randint(0, 99, (t,), generator=gen)
    return StepValues(
        input_ids=ids.to(DEVICE),
        positions=torch.randint(0, 4096, (t,), generator=gen).to(DEVICE),
        slots={k: torch.randint(0, 9999, (t,), generator=gen).to(DEVICE) for k in KINDS},
        context_lens=torch.randint(1, 4096, (n,), generator=gen, dtype=torch.int32).to(DEVICE),
        block_tables=tables,
        previous=torch.randint(0, 201088, (previous,), generator=gen).to(DEVICE) if previous else None,
    )


def clone(buffers: GraphInputs) -> GraphInputs:
    return GraphInputs(
        buffers.input_ids.clone(),
        buffers.positions.clone(),
        {k: v.clone() for k, v in buffers.slots.items()},
        buffers.context_lens.clone(),
        {k: v.clone() for k, v in buffers.block_tables.items()},
        buffers.valid_tokens.clone(),
    )


def assert_same(a: GraphInputs, b: GraphInputs) -> None:
    for name in ("input_ids", "positions", "context_lens", "valid_tokens"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    for k in KINDS:
        assert torch.equal(a.slots[k].cpu(), b.slots[k].cpu()), f"slots {k}"
        assert torch.equal(a.block_tables[k].cpu(), b.block_tables[k].cpu()), f"table {k}"


def test_reference_pads_the_graph_rows():
    gen = torch.Generator().manual_seed(0)
    dst, src = junk_buffers(4, 2, 9, gen), step_values(3, 2, 5, gen)
    old_ids = dst.input_ids.clone()
    fill_graph_inputs_reference(dst, src, q=2)
    assert dst.input_ids[:6].tolist() == src.input_ids.tolist()
    assert dst.input_ids[6:].tolist() == old_ids[6:].tolist()  # padding rows' ids are never read
    assert dst.context_lens.tolist() == src.context_lens.tolist() + [2]
    assert dst.valid_tokens.tolist() == [6]  # the real tokens, 3 sequences of 2
    for k in KINDS:
        assert dst.slots[k].tolist() == src.slots[k].tolist() + [-1, -1]
        table = dst.block_tables[k]
        assert table[:3, :5].tolist() == src.block_tables[k].tolist()
        assert (table[:3, 5:] == -1).all() and (table[3:] == 0).all()


@needs_triton
@pytest.mark.parametrize(
    "b,n,q,w,p",
    [
        (1, 1, 1, 3, 40),  # batch 1
        (8, 5, 1, 17, 2 * BLOCK_P + 9),  # padding rows, several column blocks
        (4, 4, 3, 2, 11),  # verification: 3 tokens a sequence, no padding
        (8, 3, 3, 2 * BLOCK_P + 1, 2 * BLOCK_P + 1),  # tables exactly as wide as the graph's
    ],
)
@pytest.mark.parametrize("gather", [False, True])
def test_triton_fill_matches_reference(kernels, b, n, q, w, p, gather):
    gen = torch.Generator().manual_seed(b * 100 + n * 10 + q + gather)
    dst = junk_buffers(b, q, p, gen)
    src = step_values(n, q, w, gen, previous=7 if gather else 0)
    expected = clone(dst)
    fill_graph_inputs_reference(expected, src, q)
    kernels.fill_graph_inputs_triton(dst, src, q)
    assert_same(dst, expected)


@needs_triton
def test_triton_fill_rejects_what_does_not_fit(kernels):
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.fill_graph_inputs_triton(junk_buffers(2, 1, 4, gen), step_values(2, 1, 5, gen), 1)
    with pytest.raises(ValueError, match="at most"):
        kernels.fill_graph_inputs_triton(junk_buffers(2, 1, 8, gen), step_values(3, 1, 5, gen), 1)
    strided = step_values(2, 1, 5, gen)
    strided.positions = torch.arange(4, device=DEVICE)[::2]
    with pytest.raises(ValueError, match="unit-stride"):
        kernels.fill_graph_inputs_triton(junk_buffers(2, 1, 8, gen), strided, 1)
