"""Row-wise argmax of logits, plain (greedy sampling) or raced (sampling), spread over many programs.

`torch.argmax(x, dim=-1)` reduces a single 201k-wide row (batch-1 decode) in one multi-block
launch that took 8 µs plus a memset on an H200, a few percent of a whole decode step. Here
program (row, chunk) reduces CHUNK values to a (maximum, first index) pair and a second small
launch picks each row's best pair: both are short and fill the GPU at any batch size.

Result as `argmax_reference` (`torch.argmax`): the first index of the row's maximum, except that
NaN is read as +inf (torch ranks NaN above +inf; a row with both is a broken model either way).
Nothing syncs with the host, so it can run inside a CUDA graph.

The race (`race_argmax_rows_triton`) samples a row at temperature T in the same single pass:
argmax over v of x_v / T - log(E_v), E_v ~ Exp(1), is a draw from softmax(x / T) (the
exponential race: the softmax's normaliser does not move the argmax, so it is never computed).
Each program draws its own E_v from Philox keyed by the row's key, and nothing [N, V] is
written: done with torch ops (scale, softmax, noise, divide, argmax) the same draw reads and
writes about a dozen [N, V] float32 tensors, 0.5-1 ms a step at 256 rows of gpt-oss's 201k
vocabulary. A row may race above a floor, the least x_v / T its top_k / top_p / min_p keep (the
others never win). `race_reference` is the definition, given the uniforms `race_uniforms` draws.
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
# The race's uniforms: 23 random bits (k + 0.5) / 2^23, strictly inside (0, 1) and exact in
# float32, so -log(-log(u)) is always finite (a u of 0 or 1 would make a token certain or
# impossible whatever its logit).
UNIFORM_BITS = 23


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [N, V] -> [N] int64, the first index of each row's maximum."""
    return x.argmax(dim=-1)


def race_reference(
    x: torch.Tensor, inv_temp: torch.Tensor, uniforms: torch.Tensor, floors: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [N, V] logits; inv_temp: [N] float32, 1 / temperature, 0 for a plain argmax; uniforms:
    [N, V] in (0, 1); floors: None or [N] float32 -> [N] int64, argmax of x * inv_temp -
    log(-log(uniforms)) over the columns where x * inv_temp >= floors for the raced rows (NaN
    read as +inf, as the kernels do)."""
    xf = x.float()
    xf = torch.where(torch.isnan(xf), float("inf"), xf)
    scaled = xf * inv_temp[:, None]
    raced_scores = scaled - torch.log(-torch.log(uniforms))
    if floors is not None:
        raced_scores = raced_scores.masked_fill(~(scaled >= floors[:, None]), float("-inf"))  # as the kernel
    return torch.where(inv_temp[:, None] > 0, raced_scores, xf).argmax(dim=-1)


if triton is not None:

    @triton.jit
    def _logits(base, cols, V):
        """A row's logits at cols as float32: -inf past V, NaN read as +inf."""
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        return tl.where(x != x, float("inf"), x)

    @triton.jit
    def _chunk_argmax(base, c, V, CHUNK: tl.constexpr):
        """(max, its first index within the chunk) over a row's columns [c*CHUNK, (c+1)*CHUNK)."""
        x = _logits(base, c * CHUNK + tl.arange(0, CHUNK), V)
        return tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)

    @triton.jit
    def _argmax_partial_kernel(X, part_value, part_index, V, stride_x, num_chunks, CHUNK: tl.constexpr):
        """Program (row, c): max and its first index over columns [c*CHUNK, (c+1)*CHUNK)."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        best, where = _chunk_argmax(X + row.to(tl.int64) * stride_x, c, V, CHUNK)
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

    _DROPPED_BITS = tl.constexpr(32 - UNIFORM_BITS)
    _UNIFORM_STEP = tl.constexpr(2.0**-UNIFORM_BITS)

    @triton.jit
    def _uniforms(bits):
        """Philox's 32-bit words -> float32 uniforms (k + 0.5) / 2^23, k their top 23 bits."""
        return ((bits >> _DROPPED_BITS).to(tl.float32) + 0.5) * _UNIFORM_STEP

    @triton.jit
    def _raced_quarter(base, cols, V, inv_t, floor, bits):
        """(max, first index) over one quarter of a chunk of x * inv_t - log(-log(u)), -inf where
        x * inv_t is below floor."""
        scaled = _logits(base, cols, V) * inv_t
        score = tl.where(scaled >= floor, scaled - tl.log(-tl.log(_uniforms(bits))), float("-inf"))
        return tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)

    @triton.jit
    def _race_partial_kernel(
        X, inv_temp, keys, floors, part_value, part_index, V, stride_x, num_chunks, CHUNK: tl.constexpr
    ):
        """Program (row, c): the raced max and its first index over columns [c*CHUNK, (c+1)*CHUNK)
        (a plain argmax where inv_temp[row] is 0). One Philox call gives four words for each
        offset c*CHUNK/4 + q: word p is column c*CHUNK + p*CHUNK/4 + q's. floors: None, or each
        row's least x * inv_temp that may win (-inf: any)."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        base = X + row.to(tl.int64) * stride_x
        inv_t = tl.load(inv_temp + row)
        QUARTER: tl.constexpr = CHUNK // 4
        q = tl.arange(0, QUARTER)
        first = c * CHUNK + q
        if inv_t > 0:
            floor = float("-inf") if floors is None else tl.load(floors + row)
            r0, r1, r2, r3 = tl.randint4x(tl.load(keys + row), c * QUARTER + q)
            best, where = _raced_quarter(base, first, V, inv_t, floor, r0)
            b, w = _raced_quarter(base, first + QUARTER, V, inv_t, floor, r1)
            best, where = tl.where(b > best, b, best), tl.where(b > best, w + QUARTER, where)
            b, w = _raced_quarter(base, first + 2 * QUARTER, V, inv_t, floor, r2)
            best, where = tl.where(b > best, b, best), tl.where(b > best, w + 2 * QUARTER, where)
            b, w = _raced_quarter(base, first + 3 * QUARTER, V, inv_t, floor, r3)
            best, where = tl.where(b > best, b, best), tl.where(b > best, w + 3 * QUARTER, where)
        else:
            best, where = _chunk_argmax(base, c, V, CHUNK)
        tl.store(part_value + row * num_chunks + c, best)
        tl.store(part_index + row * num_chunks + c, c * CHUNK + where)

    @triton.jit
    def _race_uniforms_kernel(keys, out, V, CHUNK: tl.constexpr):
        """out[row, :V] = the uniforms `_race_partial_kernel` draws for that row's columns."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        QUARTER: tl.constexpr = CHUNK // 4
        q = tl.arange(0, QUARTER)
        first = c * CHUNK + q
        r0, r1, r2, r3 = tl.randint4x(tl.load(keys + row), c * QUARTER + q)
        dst = out + row.to(tl.int64) * V
        tl.store(dst + first, _uniforms(r0), mask=first < V)
        tl.store(dst + first + QUARTER, _uniforms(r1), mask=first + QUARTER < V)
        tl.store(dst + first + 2 * QUARTER, _uniforms(r2), mask=first + 2 * QUARTER < V)
        tl.store(dst + first + 3 * QUARTER, _uniforms(r3), mask=first + 3 * QUARTER < V)


def _rows_argmax(x: torch.Tensor, caller: str, launch_partial) -> torch.Tensor:
    """The two launches both argmaxes share: launch_partial(part_value, part_index, chunks) runs
    the (row, chunk) programs that fill each chunk's (max, first index), then
    `_argmax_final_kernel` picks each row's best. x: [N, V] -> [N] int64 on x's device."""
    n, v = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"{caller} needs rows with unit column stride")
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    chunks = triton.cdiv(v, CHUNK)
    part_value = torch.empty(n, chunks, dtype=torch.float32, device=x.device)
    part_index = torch.empty(n, chunks, dtype=torch.int32, device=x.device)
    launch_partial(part_value, part_index, chunks)
    _argmax_final_kernel[(n,)](part_value, part_index, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=4)
    return out


def argmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [N, V] (unit column stride, float) -> [N] int64 on x's device; see the module docstring."""

    def partial(part_value, part_index, chunks):
        _argmax_partial_kernel[(x.shape[0], chunks)](
            x, part_value, part_index, x.shape[1], x.stride(0), chunks, CHUNK=CHUNK, num_warps=4
        )

    return _rows_argmax(x, "argmax_rows_triton", partial)


def race_argmax_rows_triton(
    x: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor, floors: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [N, V] (unit column stride, float); inv_temp: [N] float32 (1 / temperature; 0: a plain
    argmax); keys: [N] int64, each raced row's Philox key; floors: None or [N] float32, each
    raced row's least x * inv_temp that may be drawn (top_k / top_p / min_p as a threshold;
    -inf: none) -> [N] int64 on x's device: each raced row a draw from softmax(x * inv_temp)
    over its columns at or above its floor, the others their argmax (see the module docstring)."""

    def partial(part_value, part_index, chunks):
        _race_partial_kernel[(x.shape[0], chunks)](
            x, inv_temp, keys, floors, part_value, part_index, x.shape[1], x.stride(0), chunks, CHUNK=CHUNK, num_warps=4
        )

    return _rows_argmax(x, "race_argmax_rows_triton", partial)


def race_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N] int64 keys -> [N, vocab] float32: the uniforms the race draws for each row's columns."""
    out = torch.empty(keys.shape[0], vocab, dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _race_uniforms_kernel[(keys.shape[0], triton.cdiv(vocab, CHUNK))](keys, out, vocab, CHUNK=CHUNK, num_warps=4)
    return out


def on_triton(x: torch.Tensor) -> bool:
    """Whether logits x take the Triton kernels: wide rows with unit column stride on CUDA."""
    return triton is not None and x.is_cuda and x.dim() == 2 and x.shape[1] >= MIN_WIDTH and x.stride(1) == 1


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of logits x [N, V]: the Triton kernels on CUDA for wide rows, torch elsewhere."""
    if on_triton(x):
        return argmax_rows_triton(x)
    return argmax_reference(x)
