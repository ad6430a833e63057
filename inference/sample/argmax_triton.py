"""Row-wise argmax of logits for greedy sampling, spread over many programs.

`torch.argmax(x, dim=-1)` reduces a single 201k-wide row (batch-1 decode) in one multi-block
launch that took 8 µs plus a memset on an H200, a few percent of a whole decode step. Here
program (row, chunk) reduces CHUNK values to a (maximum, first index) pair and a second small
launch picks each row's best pair: both are short and fill the GPU at any batch size.

Result as `argmax_reference` (`torch.argmax`): the first index of the row's maximum, except that
NaN is read as +inf (torch ranks NaN above +inf; a row with both is a broken model either way).
Nothing syncs with the host, so it can run inside a CUDA graph.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference below needs no Triton
    triton = None

CHUNK = 2048  # values a program reduces: ~100 programs for one gpt-oss row (201,088 values)
MIN_WIDTH = 4 * CHUNK  # narrower rows take torch.argmax (too few programs to be worth 2 launches)


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [N, V] -> [N] int64, the first index of each row's maximum."""
    return x.argmax(dim=-1)


if triton is not None:

    @triton.jit
    def _argmax_partial_kernel(X, part_value, part_index, V, stride_x, num_chunks, CHUNK: tl.constexpr):
        """Program (row, c): max and its first index over columns [c*CHUNK, (c+1)*CHUNK)."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(part_value + row * num_chunks + c, best)
        tl.store(part_index + row * num_chunks + c, c * CHUNK + where)

    @triton.jit
    def _argmax_final_kernel(part_value, part_index, out, num_chunks, BLOCK_C: tl.constexpr):
        """out[row] = the index of the row's best partial; ties go to the earliest chunk, whose
        columns come first, so the result is the first index of the maximum."""
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        v = tl.load(part_value + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
        _, j = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out + row, tl.load(part_index + row * num_chunks + j).to(tl.int64))


def argmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [N, V] (unit column stride, float) -> [N] int64 on x's device; see the module docstring."""
    n, v = x.shape
    if x.stride(1) != 1:
        raise ValueError("argmax_rows_triton needs rows with unit column stride")
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    chunks = triton.cdiv(v, CHUNK)
    part_value = torch.empty(n, chunks, dtype=torch.float32, device=x.device)
    part_index = torch.empty(n, chunks, dtype=torch.int32, device=x.device)
    _argmax_partial_kernel[(n, chunks)](x, part_value, part_index, v, x.stride(0), chunks, CHUNK=CHUNK, num_warps=4)
    _argmax_final_kernel[(n,)](part_value, part_index, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=4)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of logits x [N, V]: the Triton kernels on CUDA for wide rows, torch elsewhere."""
    if triton is not None and x.is_cuda and x.dim() == 2 and x.shape[1] >= MIN_WIDTH and x.stride(1) == 1:
        return argmax_rows_triton(x)
    return argmax_reference(x)
