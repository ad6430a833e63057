"""A decode step's inputs written into a captured CUDA graph's static buffers, in one launch.

A captured graph reads fixed buffers (`inference/runner/cuda_graphs.py`): token ids, positions and KV
slots per token, context lengths and block tables per sequence, sized for the captured batch.
Each step fills the real rows from its packed inputs (`inference/runner/step_inputs.py`) and pads the
rest: padding sequences get context = tokens per sequence, slot -1 (no KV write) and a table
of page 0; table columns past the step's width get -1; the count of real tokens goes to
`valid_tokens` (the MoE routes the padding rows nowhere). `fill_graph_inputs_reference` does
that with a copy or fill per buffer: ten small operations, each a launch and a gap of a few
microseconds before the graph can start (about 20 µs a step at batch 1 on an H200).
`fill_graph_inputs_triton` writes every buffer in one launch and can also take the token ids
from the previous step's sampled ids on the device (async scheduling), which would otherwise be
one more gather.

Program (r, block) of the kernel writes table columns [block * BLOCK_P, +BLOCK_P) of row r in
both tables; block 0 also writes row r's context length and the ids, positions and slots of its
tokens (Q per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference below needs no Triton
    triton = None

BLOCK_P = 512  # table columns a program writes


@dataclass
class GraphInputs:
    """A captured graph's input buffers (B sequences of Q tokens, P table columns)."""

    input_ids: torch.Tensor  # [B*Q] int64
    positions: torch.Tensor  # [B*Q] int64
    slots: dict[str, torch.Tensor]  # "full", "sliding": [B*Q] int64
    context_lens: torch.Tensor  # [B] int32
    block_tables: dict[str, torch.Tensor]  # "full", "sliding": [B, P] int32
    valid_tokens: torch.Tensor | None = None  # [1] int32: the step's real tokens (n*Q)


@dataclass
class StepValues:
    """The real rows of one step (n sequences, t = n*Q tokens, tables w columns wide), on the device.
    input_ids are token ids, or with `previous` given, rows of `previous` (earlier sampled ids)."""

    input_ids: torch.Tensor  # [t] int64
    positions: torch.Tensor  # [t] int64
    slots: dict[str, torch.Tensor]  # [t] int64
    context_lens: torch.Tensor  # [n] int32
    block_tables: dict[str, torch.Tensor]  # [n, w] int32
    previous: torch.Tensor | None = None  # [*] int64


KINDS = ("full", "sliding")


def fill_graph_inputs_reference(dst: GraphInputs, src: StepValues, q: int) -> None:
    """The definition: one copy or fill per buffer."""
    t = src.input_ids.shape[0]
    n = t // q
    ids = src.input_ids if src.previous is None else src.previous[src.input_ids]
    dst.input_ids[:t].copy_(ids, non_blocking=True)
    dst.positions[:t].copy_(src.positions, non_blocking=True)
    dst.context_lens[:n].copy_(src.context_lens, non_blocking=True)
    dst.context_lens[n:].fill_(q)
    if dst.valid_tokens is not None:
        dst.valid_tokens.fill_(t)
    for kind in KINDS:
        dst.slots[kind][:t].copy_(src.slots[kind], non_blocking=True)
        dst.slots[kind][t:].fill_(-1)
        table = src.block_tables[kind]
        dst.block_tables[kind][:n, : table.shape[1]].copy_(table, non_blocking=True)
        dst.block_tables[kind][:n, table.shape[1] :].fill_(-1)
        dst.block_tables[kind][n:].fill_(0)


if triton is not None:
    # Sizes and strides vary from step to step: not specialised (Triton would compile a variant
    # for each that is 1 or a multiple of 16, in the middle of serving).
    @triton.jit(do_not_specialize=["n", "w", "P", "stride_full", "stride_sliding"])
    def _fill_kernel(
        ids_out,
        pos_out,
        slot_full_out,
        slot_sliding_out,
        ctx_out,
        table_full_out,
        table_sliding_out,
        valid_out,
        ids_in,
        previous,
        pos_in,
        slot_full_in,
        slot_sliding_in,
        ctx_in,
        table_full_in,
        table_sliding_in,
        n,
        w,
        P,
        stride_full,
        stride_sliding,
        Q: tl.constexpr,
        Q_POW2: tl.constexpr,
        GATHER: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        """Program (r, block): see the module docstring. Output tables are contiguous [B, P]."""
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        real = r < n
        src_ok = (cols < w) & (r + tl.zeros_like(cols) < n)
        col_ok = cols < P
        pad = tl.where(real, -1, 0)  # past the step's width: -1; padding rows: page 0
        full = tl.load(table_full_in + r * stride_full + cols, mask=src_ok, other=0)
        tl.store(table_full_out + r * P + cols, tl.where(src_ok, full, pad), mask=col_ok)
        sliding = tl.load(table_sliding_in + r * stride_sliding + cols, mask=src_ok, other=0)
        tl.store(table_sliding_out + r * P + cols, tl.where(src_ok, sliding, pad), mask=col_ok)
        if tl.program_id(1) == 0:
            j = tl.arange(0, Q_POW2)
            tok = r * Q + j
            tok_ok = j < Q
            mine = tok_ok & (tok < n * Q)  # a real row's tokens
            ids = tl.load(ids_in + tok, mask=mine, other=0)
            if GATHER:
                ids = tl.load(previous + ids, mask=mine, other=0)
            tl.store(ids_out + tok, ids, mask=mine)
            tl.store(pos_out + tok, tl.load(pos_in + tok, mask=mine, other=0), mask=mine)
            tl.store(slot_full_out + tok, tl.load(slot_full_in + tok, mask=mine, other=-1), mask=tok_ok)
            tl.store(slot_sliding_out + tok, tl.load(slot_sliding_in + tok, mask=mine, other=-1), mask=tok_ok)
            ctx = tl.load(ctx_in + tl.minimum(r, n - 1))  # n >= 1
            tl.store(ctx_out + r, tl.where(real, ctx, Q))
            if valid_out is not None:
                if r == 0:
                    tl.store(valid_out, n * Q)


def fill_graph_inputs_triton(dst: GraphInputs, src: StepValues, q: int) -> None:
    """`fill_graph_inputs_reference` in one launch (the source tables need unit column stride)."""
    t = src.input_ids.shape[0]
    n = t // q
    b, p = dst.block_tables["full"].shape
    if t != n * q or not 0 < n <= b:
        raise ValueError(f"{t} tokens do not make 1 to at most {b} sequences of {q}")
    full, sliding = src.block_tables["full"], src.block_tables["sliding"]
    w = full.shape[1]
    if sliding.shape[1] != w or full.stride(1) != 1 or sliding.stride(1) != 1:
        raise ValueError("both block tables need the same width and unit column stride")
    if w > p:
        raise ValueError(f"block tables {w} pages wide do not fit the graph's {p}")
    if not all(
        t.is_contiguous()
        for t in (*dst.block_tables.values(), *dst.slots.values(), dst.input_ids, dst.positions, dst.context_lens)
    ):
        raise ValueError("the graph's buffers must be contiguous")
    vectors = (src.input_ids, src.positions, *src.slots.values(), src.context_lens)
    if src.previous is not None:
        vectors += (src.previous,)
    if any(v.dim() != 1 or v.stride(0) != 1 for v in vectors):
        raise ValueError("ids, positions, slots, context lengths and previous ids must be unit-stride vectors")
    gather = src.previous is not None
    _fill_kernel[(b, triton.cdiv(p, BLOCK_P))](
        dst.input_ids,
        dst.positions,
        dst.slots["full"],
        dst.slots["sliding"],
        dst.context_lens,
        dst.block_tables["full"],
        dst.block_tables["sliding"],
        dst.valid_tokens,
        src.input_ids,
        src.previous if gather else src.input_ids,
        src.positions,
        src.slots["full"],
        src.slots["sliding"],
        src.context_lens,
        full,
        sliding,
        n,
        w,
        p,
        full.stride(0),
        sliding.stride(0),
        Q=q,
        Q_POW2=triton.next_power_of_2(q),
        GATHER=gather,
        BLOCK_P=BLOCK_P,
        num_warps=4,
    )


def fill_graph_inputs(dst: GraphInputs, src: StepValues, q: int) -> None:
    """The one-launch kernel where Triton runs (CUDA), the reference elsewhere."""
    if triton is not None and dst.input_ids.is_cuda:
        fill_graph_inputs_triton(dst, src, q)
    else:
        fill_graph_inputs_reference(dst, src, q)
