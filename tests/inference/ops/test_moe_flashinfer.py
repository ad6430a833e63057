"""flashinfer's SM90 fused MoE backend (`inference/ops/moe/flashinfer.py`) against the float32 reference.

GPU tests need CUDA, flashinfer and an SM90 GPU, and skip otherwise. They compare with
`moe_reference` math in float32 on random MXFP4 weights: the expert part for given routing
(exactly the reference's experts), and the whole block with its bf16 router, where tokens whose
4th and 5th float32 logits lie within bf16 rounding of each other are left out (either choice is
right there). On a mismatch the message lists the error against plausible other conventions
(gate/up swapped, no "+1" on up, no clamp; weights or scales not interleaved) so one run shows
which convention the kernel follows.

CPU tests (run in CI): choosing "flashinfer" where it cannot run is a clear error, the model
loads and runs with flashinfer absent, and, where flashinfer is importable, the padded
[up ; gate] layout holds exactly the checkpoint's values.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

from inference.ops.moe.backend import select_moe_backend
from inference.ops.moe.flashinfer import flashinfer_available, flashinfer_supports
from inference.ops.moe.reference import MoEWeights, moe_reference, route, swiglu
from inference.ops.mxfp4 import dequantize_mxfp4
from tests.moe_layers import random_mxfp4_layer

CUDA = torch.cuda.is_available()
HAVE_FLASHINFER = flashinfer_available()
SM90 = CUDA and HAVE_FLASHINFER and flashinfer_supports("cuda")
_sm90 = pytest.mark.skipif(CUDA and not SM90, reason="needs flashinfer" if not HAVE_FLASHINFER else "needs an SM90 GPU")


def gpu(test):
    """An SM90 GPU with flashinfer (skipped without CUDA by the `gpu` marker)."""
    return pytest.mark.gpu(_sm90(test))


# OSS_AGENT_FLASHINFER_MOE_MODULE: a subset build of flashinfer's fused-MoE module
# (experiments/flashinfer_moe_subset.py) to test instead of its JIT build, which takes longer than
# is practical (tens of minutes). That build holds no other JIT module, so the router stays in torch.
PREBUILT_MODULE = os.environ.get("OSS_AGENT_FLASHINFER_MOE_MODULE")
if PREBUILT_MODULE and SM90:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))
    from flashinfer_moe_subset import use_prebuilt

    use_prebuilt(PREBUILT_MODULE)
LIMIT = 7.0
TOP_K = 4
MAX_REL_ERR = 1e-2
# (experts, hidden, intermediate): no padding (and tinygemm's E % 16), and gpt-oss's 2880 (pads to 2944).
SMALL = (16, 256, 128)
GPT_OSS = (32, 2880, 2880)


# ----------------------------------------------------------------------------- helpers


def float_router(w: MoEWeights) -> MoEWeights:
    return dataclasses.replace(w, router_weight=w.router_weight.float(), router_bias=w.router_bias.float())


def shallow_copy(w: MoEWeights) -> MoEWeights:
    """prepare() releases the packed tensors it is given; the reference keeps the originals."""
    return dataclasses.replace(w, experts=dataclasses.replace(w.experts))


def experts_reference(x, w: MoEWeights, ids, gates, *, swap=False, beta=1.0, clamp=True) -> torch.Tensor:
    """The reference's experts (float32) for given routing; the keywords give other conventions."""
    xf = x.float()
    out = torch.zeros_like(xf)
    ex = w.experts
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        w1, w2 = ex.expert_matrices(e)
        h = xf[token] @ w1 + ex.gate_up_bias[e].float()
        if not swap and beta == 1.0 and clamp:
            act = swiglu(h, LIMIT)  # the contract itself
        else:
            gate, up = (h[..., 1::2], h[..., 0::2]) if swap else (h[..., 0::2], h[..., 1::2])
            if clamp:
                gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            act = (up + beta) * gate * torch.sigmoid(1.702 * gate)
        y = act @ w2 + ex.down_bias[e].float()
        out.index_add_(0, token, y * gates[token, slot, None].float())
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def backend_and_prepared(w: MoEWeights):
    from inference.ops.moe.flashinfer import FlashInferMoEBackend

    backend = FlashInferMoEBackend()
    if PREBUILT_MODULE:
        backend.tinygemm_max_tokens = 0  # tinygemm is a JIT module of its own (as in bench_moe.py)
    return backend, backend.prepare(shallow_copy(w))


def diagnose(backend, w: MoEWeights, x, ids, gates, out) -> str:
    """Errors of `out` against other conventions, and of other weight layouts against the reference."""
    from inference.ops.moe.flashinfer import prepare_flashinfer_weights

    lines = ["errors against other conventions (the smallest names the kernel's):"]
    conventions = (
        ("as specified", {}),
        ("gate/up swapped", dict(swap=True)),
        ("beta 0 (no +1 on up)", dict(beta=0.0)),
        ("no clamp", dict(clamp=False)),
        ("swapped, beta 0", dict(swap=True, beta=0.0)),
    )
    for label, kw in conventions:
        lines.append(f"  {label:24s} {rel_err(out, experts_reference(x, w, ids, gates, **kw)):.3e}")
    ref = experts_reference(x, w, ids, gates)
    lines.append("other weight layouts against the reference:")
    layouts = (
        ("rows [gate ; up]", dict(swap_gate_up=True)),
        ("weights not interleaved", dict(interleave_weights=False)),
        ("scales not interleaved", dict(interleave_scales=False)),
        ("neither interleaved", dict(interleave_weights=False, interleave_scales=False)),
    )
    for label, kw in layouts:
        try:
            variant = backend.experts(x, prepare_flashinfer_weights(w, **kw), ids, gates, LIMIT)
            lines.append(f"  {label:24s} {rel_err(variant, ref):.3e}")
        except Exception as exc:  # a layout the kernel refuses still informs
            lines.append(f"  {label:24s} failed: {type(exc).__name__}: {str(exc)[:100]}")
    return "\n".join(lines)


def check_experts(backend, prepared, w: MoEWeights, x, ids, gates) -> None:
    out = backend.experts(x, prepared, ids.to(torch.int32), gates, LIMIT)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "non-finite output"
    err = rel_err(out, experts_reference(x, w, ids, gates))
    if err >= MAX_REL_ERR:
        pytest.fail(f"|out - ref| / |ref| = {err:.3e} >= {MAX_REL_ERR}\n" + diagnose(backend, w, x, ids, gates, out))


def decisive_tokens(x, w: MoEWeights, top_k: int) -> torch.Tensor:
    """Tokens whose k-th and (k+1)-th float32 router logits differ by more than bf16 rounding."""
    fw = float_router(w)
    logits = torch.nn.functional.linear(x.float(), fw.router_weight, fw.router_bias)
    top = torch.topk(logits, top_k + 1, dim=-1).values
    margin = top[:, top_k - 1] - top[:, top_k]
    return margin > 2 * 2.0**-8 * top[:, :top_k].abs().amax(dim=-1).clamp_min(1.0)


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("shape", [SMALL, GPT_OSS], ids=["small", "gpt-oss"])
def test_experts_match_reference(shape):
    """Given the reference's routing, flashinfer's experts are the reference's, at batches where
    most experts get no tokens (1, 7) and where most get several (64, 300)."""
    w = random_mxfp4_layer(*shape, seed=1)
    backend, prepared = backend_and_prepared(w)
    for t in (1, 7, 64, 300):
        x = torch.randn(t, shape[1], device="cuda").bfloat16()
        ids, gates = route(x.float(), float_router(w), TOP_K)
        check_experts(backend, prepared, w, x, ids, gates)


@gpu
@pytest.mark.parametrize("shape", [SMALL, GPT_OSS], ids=["small", "gpt-oss"])
def test_forward_matches_reference(shape):
    """The whole block (bf16 router, tinygemm for small batches) against `moe_reference` in
    float32, on the tokens whose routing is decided beyond bf16 rounding."""
    w = random_mxfp4_layer(*shape, seed=2)
    backend, prepared = backend_and_prepared(w)
    for t in (1, 7, 64, 300):
        x = torch.randn(t, shape[1], device="cuda").bfloat16()
        keep = decisive_tokens(x, w, TOP_K)
        assert keep.float().mean() > 0.8 or t < 8, "too few decisive tokens for a meaningful check"
        out = backend.forward(x, prepared, TOP_K, LIMIT)
        assert out.shape == x.shape and torch.isfinite(out).all()
        ids, _ = backend.route(x, prepared, TOP_K)
        want_ids, _ = route(x.float(), float_router(w), TOP_K)
        assert torch.equal(ids[keep].sort(-1).values.long(), want_ids[keep].sort(-1).values), "routing differs"
        if keep.any():
            ref = moe_reference(x.float(), float_router(w), TOP_K, LIMIT)
            assert rel_err(out[keep], ref[keep]) < MAX_REL_ERR


@gpu
@pytest.mark.parametrize("shape", [SMALL, GPT_OSS], ids=["small", "gpt-oss"])
def test_every_token_picks_the_same_experts(shape):
    """Four experts get every token, the rest none."""
    w = random_mxfp4_layer(*shape, seed=3)
    bias = torch.zeros(shape[0], device="cuda")
    bias[[1, 5, 9, 12]] = torch.tensor([50.0, 40.0, 30.0, 20.0], device="cuda")
    w.router_bias = bias.bfloat16()
    backend, prepared = backend_and_prepared(w)
    x = torch.randn(300, shape[1], device="cuda").bfloat16()
    ids, gates = route(x.float(), float_router(w), TOP_K)
    assert set(ids.flatten().tolist()) == {1, 5, 9, 12}
    check_experts(backend, prepared, w, x, ids, gates)
    out = backend.forward(x, prepared, TOP_K, LIMIT)
    assert torch.isfinite(out).all()
    assert rel_err(out, moe_reference(x.float(), float_router(w), TOP_K, LIMIT)) < MAX_REL_ERR


@gpu
@pytest.mark.parametrize("t", [1, 8, 64])
def test_cuda_graph_capture(t):
    """forward has no host synchronisation: it captures in a graph and replays on new inputs."""
    w = random_mxfp4_layer(*SMALL, seed=4)
    backend, prepared = backend_and_prepared(w)
    x = torch.randn(t, SMALL[1], device="cuda").bfloat16()
    backend.forward(x, prepared, TOP_K, LIMIT)  # JIT, workspace and limit tensor outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = backend.forward(x, prepared, TOP_K, LIMIT)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(2):
        x.copy_(torch.randn(t, SMALL[1], generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
        graph.replay()
        eager = backend.forward(x, prepared, TOP_K, LIMIT)
        assert torch.isfinite(out).all()
        assert rel_err(out, eager) < MAX_REL_ERR  # a stale replay would be ~100% off


@gpu
def test_prepare_releases_packed_weights_and_checks_input():
    w = random_mxfp4_layer(*SMALL, seed=5)
    backend = select_moe_backend("cuda", "flashinfer")
    copy = shallow_copy(w)
    prepared = backend.prepare(copy)
    assert copy.experts.gate_up_blocks is None and copy.experts.down_blocks is None
    assert backend.forward(
        torch.empty(0, SMALL[1], device="cuda", dtype=torch.bfloat16), prepared, TOP_K, LIMIT
    ).shape == (0, SMALL[1])
    with pytest.raises(ValueError):
        backend.forward(torch.zeros(2, SMALL[1], device="cuda"), prepared, TOP_K, LIMIT)  # float32


# ----------------------------------------------------------------------------- CPU


def test_select_flashinfer_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(RuntimeError, match="flashinfer MoE backend needs flashinfer and an SM90"):
        select_moe_backend("cpu", "flashinfer")


def test_model_loads_and_runs_without_flashinfer(tmp_path, monkeypatch):
    """With flashinfer not importable: the module imports, selection says why, and the tiny
    model loads and runs its MoE on the default backend."""
    from inference.model.gpt_oss import GptOssModel
    from inference.model.tiny_checkpoint import write_tiny_checkpoint

    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails, find_spec says absent
    import inference.ops.moe.flashinfer as moe_flashinfer

    assert not moe_flashinfer.flashinfer_available()
    with pytest.raises(ImportError):
        moe_flashinfer.FlashInferMoEBackend()
    path = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    with pytest.raises(RuntimeError, match="flashinfer is not installed"):
        GptOssModel.from_pretrained(path, device="cpu", moe_backend="flashinfer")
    model = GptOssModel.from_pretrained(path, device="cpu")
    assert model.moe_backend.name == "reference"
    mlp = model.layers[0].mlp
    h = torch.randn(5, model.config.hidden_size)
    out = mlp(h, model.moe_backend)
    assert out.shape == h.shape and torch.isfinite(out).all() and out.abs().sum() > 0


def _fold_back(s: torch.Tensor) -> torch.Tensor:
    """Undo `interleave_moe_scales_for_sm90_mixed_gemm` for uint8 scales: [E, R/64, K/128, 16, 16]
    -> [E, R, K/32] (its reshape, permute, reshape, read backwards)."""
    e, r64, k128 = s.shape[:3]
    return s.reshape(e, r64, k128, 16, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(e, r64 * 64, k128 * 4)


@pytest.mark.skipif(not HAVE_FLASHINFER, reason="needs flashinfer (importable; no GPU needed)")
@pytest.mark.parametrize("shape", [(3, 64, 96), (2, 160, 128)], ids=["pad-intermediate", "pad-hidden"])
def test_layout_holds_checkpoint_values(shape):
    """Un-interleaved weights + folded scales decode to the checkpoint's: gate_up rows [up ; gate],
    each half and the hidden size padded to 128 with zeros, biases in the same order."""
    from inference.ops.moe.flashinfer import prepare_flashinfer_weights

    e, h, i = shape
    w = random_mxfp4_layer(e, h, i, seed=6, device="cpu")
    p = prepare_flashinfer_weights(w, interleave_weights=False)
    hp, ip = -(-h // 128) * 128, -(-i // 128) * 128
    assert p.w1.shape == (e, 2 * ip, hp // 2) and p.w2.shape == (e, hp, ip // 2)
    assert p.s1.shape == (e, 2 * ip // 64, hp // 128, 16, 16) and p.b1.shape == (e, 2 * ip)

    def decode(wq, s):  # [E, R, K/2], [E, R/64, K/128, 16, 16] -> [E, R, K] float32
        blocks = wq.reshape(*wq.shape[:2], -1, 16)
        return dequantize_mxfp4(blocks, _fold_back(s), torch.float32)

    ex = w.experts
    gate_up = dequantize_mxfp4(ex.gate_up_blocks, ex.gate_up_scales, torch.float32)  # [E, 2I, H]
    down = dequantize_mxfp4(ex.down_blocks, ex.down_scales, torch.float32)  # [E, H, I]
    w1, w2 = decode(p.w1, p.s1), decode(p.w2, p.s2)
    assert torch.equal(w1[:, :i, :h], gate_up[:, 1::2]) and torch.equal(w1[:, ip : ip + i, :h], gate_up[:, 0::2])
    assert torch.equal(w2[:, :h, :i], down)
    for padded in (w1[:, i:ip], w1[:, ip + i :], w1[..., h:], w2[:, h:], w2[..., i:]):
        assert (padded == 0).all()
    bias = ex.gate_up_bias.bfloat16()
    assert torch.equal(p.b1[:, :i], bias[:, 1::2]) and torch.equal(p.b1[:, ip : ip + i], bias[:, 0::2])
    assert (p.b1[:, i:ip] == 0).all() and (p.b2[:, h:] == 0).all()
