"""Decode GEMV: the Triton `y = x @ W^T + b` kernel vs its float32 reference, and where the model uses it.

On a CUDA machine the kernel runs for real in bf16 (tiny shapes and the gpt-oss-20b projections,
relative error < 1e-2). Without CUDA it runs under Triton's interpreter (TRITON_INTERPRET=1,
float32: the interpreter multiplies bf16 `tl.dot` operands as raw integer bits, so bf16 there
would test the interpreter, not the kernel).

Every case reads x and W as views into larger NaN-filled buffers (row strides wider than K, rows
and columns past the view poisoned), so a kernel that loads outside its masks returns NaN, and
the error check turns any NaN into a failure.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from inference.ops.linear import backend as decode_linear  # noqa: E402
from inference.ops.linear.backend import DECODE_GEMV_LAYERS, DecodeLinear, gemv_supported, use_decode_gemv  # noqa: E402
from inference.ops.linear.triton import LinearConfig, linear_config, linear_reference  # noqa: E402
from tests.triton_interpreter import (  # noqa: E402  (first: sets TRITON_INTERPRET on CPU)
    CUDA,
    DEVICE,
    DTYPE,
    HAVE_TRITON,
    fresh_process_only,
    gpu_only,
    kernel_module,
    needs_triton,
    run_in_fresh_interpreter,
)

TOL = 1e-2 if CUDA else 1e-5


def _kernels():
    """The Triton module, interpreted on CPU."""
    return kernel_module("inference.ops.linear.triton", "_linear_kernel")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error; inf when y holds a NaN or inf, so such outputs always fail."""
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def poisoned(rows: int, cols: int, gen, scale: float = 1.0, dtype=DTYPE, device=DEVICE) -> torch.Tensor:
    """A random [rows, cols] view into a NaN buffer 3 rows and 13 columns larger (row stride cols + 13)."""
    store = torch.full((rows + 3, cols + 13), float("nan"), dtype=dtype, device=device)
    view = store[1 : rows + 1, 5 : cols + 5]
    view.copy_((torch.randn(rows, cols, generator=gen) * scale).to(dtype))
    return view


@pytest.fixture(scope="module")
def kernels():
    return _kernels()


@fresh_process_only
def test_triton_in_fresh_interpreter():
    """Run this file's Triton tests in a new interpreter-mode process."""
    run_in_fresh_interpreter(__file__)


# ----------------------------------------------------------------------------- reference and heuristic


def test_reference_is_the_float32_affine_map():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 7, generator=g), torch.randn(5, 7, generator=g), torch.randn(5, generator=g)
    expected = torch.einsum("mk,nk->mn", x.double(), w.double()) + b.double()
    torch.testing.assert_close(linear_reference(x, w, b).double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(linear_reference(x, w, None).double(), expected - b.double(), rtol=1e-6, atol=1e-6)
    assert linear_reference(x.bfloat16(), w.bfloat16(), b).dtype == torch.bfloat16


def test_rel_err_fails_nan():
    ref = torch.ones(4)
    assert rel_err(ref.clone(), ref) == 0.0
    assert rel_err(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) > TOL
    assert rel_err(torch.tensor([1.0, 1.0, 1.0, 2.0]), ref) > TOL


@pytest.mark.skipif(not HAVE_TRITON, reason="the heuristic uses triton.cdiv")
def test_heuristic_fills_the_gpu_and_splits_only_short_grids():
    sms = 132
    for m, n, k in [(1, 5120, 2880), (1, 2880, 4096), (4, 5120, 2880), (8, 2880, 4096), (1, 32, 2880)]:
        cfg = linear_config(m, n, k, sms)
        assert cfg.dot == (m > 1)  # the fma inner product handles exactly one row
        programs = -(-n // cfg.block_n) * cfg.split_k
        if cfg.split_k > 1:  # split only when the columns alone give too few programs
            assert -(-n // cfg.block_n) < 4 * sms and k // cfg.split_k >= 1024
        else:
            assert programs >= 4 * sms or k < 2048, (m, n, k, cfg)
    # The 20b decode shapes: qkv at M=1 fills the GPU with whole-K programs.
    assert linear_config(1, 5120, 2880, sms).split_k == 1
    # K steps: 1024 wide for o_proj's K = 4096 at 4 columns a program, 512 for qkv's 2880, and
    # 512 where a small GPU gives o_proj 16 columns a program.
    assert (linear_config(1, 2880, 4096, sms).block_n, linear_config(1, 2880, 4096, sms).block_k) == (4, 1024)
    assert linear_config(1, 5120, 2880, sms).block_k == 512
    assert (linear_config(1, 2880, 4096, 40).block_n, linear_config(1, 2880, 4096, 40).block_k) == (16, 512)


# ----------------------------------------------------------------------------- the kernel

CASES = [  # (M, N, K): N and K are not multiples of any block size tried
    (1, 37, 200),
    (3, 70, 96),
    (8, 45, 328),
]
CONFIGS = {
    "heuristic": None,
    "dot": LinearConfig(block_n=16, block_k=64, dot=True),
    "dot_split3": LinearConfig(block_n=16, block_k=32, split_k=3, dot=True),
    "fma": LinearConfig(block_n=8, block_k=64),
    "fma_split2": LinearConfig(block_n=4, block_k=32, split_k=2),
}


@needs_triton
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("m,n,k", CASES)
def test_triton_kernel_matches_reference(kernels, m, n, k, config):
    cfg = CONFIGS[config]
    if cfg is not None and not cfg.dot and m > 1:
        with pytest.raises(ValueError, match="one row"):
            kernels.linear_triton(
                torch.zeros(m, k, dtype=DTYPE, device=DEVICE), torch.zeros(n, k, dtype=DTYPE, device=DEVICE), None, cfg
            )
        return
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = poisoned(m, k, g)
    w = poisoned(n, k, g, scale=k**-0.5)
    bias = (torch.randn(n, generator=g) * 0.5).to(DTYPE).to(DEVICE)
    for b in (bias, None, bias.float()):  # bf16 or float32 bias, or none
        y = kernels.linear_triton(x, w, b, cfg)
        assert y.shape == (m, n) and y.dtype == x.dtype
        err = rel_err(y, linear_reference(x, w, b))
        assert err < TOL, (m, n, k, config, err)


@needs_triton
@pytest.mark.parametrize("m,split_k", [(1, 1), (1, 4), (5, 1)])
def test_triton_kernel_writes_the_dtype_asked_for(kernels, m, split_k):
    """out_dtype float32 (a tensor-parallel partial sum): the float32 accumulation written as it is,
    through the split-K reduction too; on a GPU from bf16 inputs, closer to the float32 reference
    than the bf16 output."""
    g = torch.Generator().manual_seed(7)
    x, w = poisoned(m, 256, g), poisoned(48, 256, g, scale=256**-0.5)
    bias = (torch.randn(48, generator=g) * 0.5).to(DTYPE).to(DEVICE)
    cfg = LinearConfig(block_n=16, block_k=64, split_k=split_k, num_warps=4, num_stages=1, dot=m > 1)
    y = kernels.linear_triton(x, w, bias, cfg, out_dtype=torch.float32)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    assert y.dtype == torch.float32 and y.shape == (m, 48)
    assert rel_err(y, ref) < (1e-5 if not CUDA else 1e-3)
    if CUDA:
        assert rel_err(y, ref) < rel_err(kernels.linear_triton(x, w, bias, cfg), ref)


@needs_triton
def test_triton_kernel_nan_input_reaches_only_its_row(kernels):
    """A NaN in one token's input poisons that token's outputs and no other row's."""
    g = torch.Generator().manual_seed(5)
    x, w = poisoned(3, 96, g), poisoned(40, 96, g)
    x[1, 50] = float("nan")
    for cfg in (CONFIGS["dot"], CONFIGS["dot_split3"]):
        y = kernels.linear_triton(x, w, None, cfg)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
        assert rel_err(y, linear_reference(x, w, None)) == float("inf")
        assert rel_err(y[[0, 2]], linear_reference(x, w, None)[[0, 2]]) < TOL


@needs_triton
def test_triton_kernel_empty_and_bad_shapes(kernels):
    w = torch.zeros(8, 16, dtype=DTYPE, device=DEVICE)
    assert kernels.linear_triton(torch.zeros(0, 16, dtype=DTYPE, device=DEVICE), w).shape == (0, 8)
    with pytest.raises(ValueError, match="columns"):
        kernels.linear_triton(torch.zeros(1, 15, dtype=DTYPE, device=DEVICE), w)
    with pytest.raises(ValueError, match="unit column stride"):
        kernels.linear_triton(
            torch.zeros(1, 16, dtype=DTYPE, device=DEVICE), torch.zeros(16, 8, dtype=DTYPE, device=DEVICE).t()
        )


# gpt-oss-20b: qkv 2880 -> 5120, o_proj 4096 -> 2880 (and its tensor-parallel half: 2048 input
# columns, a strided view of the whole matrix), lm_head 2880 -> 201088, router 2880 -> 32.
REAL_SHAPES = [(5120, 2880, True), (2880, 4096, True), (2880, 2048, True), (201088, 2880, False), (32, 2880, True)]


@gpu_only
@pytest.mark.parametrize("n,k,has_bias", REAL_SHAPES)
def test_gpu_kernel_real_shapes_bf16(n, k, has_bias):
    kernels = _kernels()
    g = torch.Generator().manual_seed(n + k)
    w_full = (torch.randn(n, 2 * k if k == 2048 else k, generator=g) * k**-0.5).to(DEVICE, torch.bfloat16)
    w = w_full[:, :k]  # the o_proj shard of rank 0 at TP=2 is such a column slice
    b = (torch.randn(n, generator=g) * 0.02).to(DEVICE, torch.bfloat16) if has_bias else None
    for m in (1, 2, 4, 8, 16, 33):
        x = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
        err = rel_err(kernels.linear_triton(x, w, b), linear_reference(x, w, b))
        assert err < 1e-2, (n, k, m, err)


@gpu_only
def test_gpu_kernel_is_graph_capturable_and_deterministic():
    kernels = _kernels()
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2880, 4096, generator=g) * 0.02).to(DEVICE, torch.bfloat16)
    b = torch.randn(2880, generator=g).to(DEVICE, torch.bfloat16)
    x = torch.randn(4, 4096, generator=g).to(DEVICE, torch.bfloat16)
    cfg = LinearConfig(block_n=32, block_k=128, split_k=4, dot=True)
    eager = kernels.linear_triton(x, w, b, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.linear_triton(x, w, b, cfg)
    x.copy_(torch.randn(4, 4096, generator=g).to(DEVICE, torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    again = kernels.linear_triton(x, w, b, cfg)
    assert torch.equal(out, again)  # split-K sums in a fixed order: bit-identical every time
    assert not torch.equal(out, eager)  # the replay read the new x


# ----------------------------------------------------------------------------- where the model uses it


def _dense(in_features=16, out_features=8) -> DecodeLinear:
    return DecodeLinear.wrapping(nn.Linear(in_features, out_features, dtype=torch.bfloat16))


def test_decode_linear_routes_only_few_bf16_rows_to_the_kernel(monkeypatch):
    kernels = importlib.import_module("inference.ops.linear.triton")
    calls = []

    def recording(x, weight, bias=None, config=None, out_dtype=None):
        calls.append(x.shape[0])
        y = torch.nn.functional.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)

    monkeypatch.setattr(kernels, "linear_triton", recording)
    layer = _dense()
    limit = decode_linear.GEMV_MAX_TOKENS
    for t in (1, limit):
        layer(torch.randn(t, 16, dtype=torch.bfloat16))
    assert calls == [1, limit]
    layer(torch.randn(limit + 1, 16, dtype=torch.bfloat16))  # a prefill chunk: cuBLAS
    DecodeLinear.wrapping(nn.Linear(16, 8))(torch.randn(2, 16))  # float32
    layer(torch.randn(2, 32, dtype=torch.bfloat16)[:, ::2])  # columns not contiguous
    layer(torch.randn(1, 2, 16, dtype=torch.bfloat16))  # not [T, K]
    one_row = DecodeLinear.wrapping(nn.Linear(16, 8, dtype=torch.bfloat16), max_tokens=1)  # qkv's limit
    one_row(torch.randn(2, 16, dtype=torch.bfloat16))
    one_row(torch.randn(1, 16, dtype=torch.bfloat16))
    assert calls == [1, limit, 1]
    # A tensor-parallel shard's partial sum in float32, from either path.
    assert layer(torch.randn(1, 16, dtype=torch.bfloat16), out_dtype=torch.float32).dtype == torch.float32
    assert layer(torch.randn(limit + 1, 16, dtype=torch.bfloat16), out_dtype=torch.float32).dtype == torch.float32
    assert calls == [1, limit, 1, 1]
    layer.max_tokens = 0  # switched off: nn.Linear's own result
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert calls == [1, limit, 1, 1]


def test_decode_linear_shares_the_wrapped_parameters():
    linear = nn.Linear(16, 8)
    layer = DecodeLinear.wrapping(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert isinstance(layer, nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    assert DecodeLinear.wrapping(nn.Linear(16, 8, bias=False)).bias is None


def test_gemv_supported_only_for_cuda_bf16_unit_stride():
    assert not gemv_supported(nn.Linear(16, 8, dtype=torch.bfloat16))  # CPU
    if CUDA and HAVE_TRITON:
        assert gemv_supported(nn.Linear(16, 8, dtype=torch.bfloat16, device="cuda"))
        assert not gemv_supported(nn.Linear(16, 8, device="cuda"))  # float32


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from inference.model.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_linear"))


def test_cpu_model_keeps_nn_linear(tiny_checkpoint):
    from inference.model.gpt_oss import GptOssModel

    model = GptOssModel.from_pretrained(tiny_checkpoint, device="cpu", progress=False)
    assert use_decode_gemv(model) == 0
    for block in model.layers:
        assert type(block.attn.qkv) is nn.Linear and type(block.attn.o_proj) is nn.Linear


@gpu_only
def test_gpu_model_logits_with_kernel_match_nn_linear(tiny_checkpoint, monkeypatch):
    """The tiny model in bf16 on the GPU: logits through the GEMV path (5-token prefill, then
    single-token decode steps) equal the nn.Linear path's within bf16 rounding."""
    from inference.model.gpt_oss import GptOssModel

    kernels = _kernels()
    real, calls = kernels.linear_triton, []

    def counting(x, weight, bias=None, config=None, **options):
        calls.append(x.shape[0])
        return real(x, weight, bias, config, **options)

    monkeypatch.setattr(kernels, "linear_triton", counting)
    from inference.runner.single_sequence import SingleSequenceCache

    model = GptOssModel.from_pretrained(tiny_checkpoint, device="cuda", dtype=torch.bfloat16, progress=False)
    dense = [getattr(block.attn, name) for block in model.layers for name in DECODE_GEMV_LAYERS]
    assert all(type(layer) is DecodeLinear for layer in dense) and len(dense) == len(DECODE_GEMV_LAYERS) * len(
        model.layers
    )
    assert [block.attn.qkv.max_tokens for block in model.layers] == [1] * len(model.layers)  # cuBLAS past 1 row
    assert use_decode_gemv(model) == 0  # already swapped
    fp32 = GptOssModel.from_pretrained(tiny_checkpoint, device="cuda", dtype=torch.float32, progress=False)
    assert all(type(block.attn.qkv) is nn.Linear for block in fp32.layers)

    ids = torch.randint(0, 200_000, (9,), generator=torch.Generator().manual_seed(3)).tolist()

    def logits():
        cache = SingleSequenceCache(model, len(ids), page_size=4)
        rows = [cache.forward(ids[:5])] + [cache.forward([t]) for t in ids[5:]]
        return torch.cat(rows)

    with_kernel = logits()
    # Every swapped layer ran the kernel in the 4 decode steps; in the prefill step (5 rows), those
    # that take 5 rows.
    prefill = [layer for layer in dense if layer.max_tokens >= 5]
    assert 0 < len(prefill) < len(dense)
    assert sorted(calls) == [1] * (4 * len(dense)) + [5] * len(prefill)
    for layer in dense:
        layer.max_tokens = 0
    with_cublas = logits()
    assert len(calls) == 4 * len(dense) + len(prefill)
    assert torch.isfinite(with_kernel).all()
    err = rel_err(with_kernel, with_cublas)
    assert err < 1e-2, err
