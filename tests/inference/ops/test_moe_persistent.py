"""The persistent batch-1 MoE kernel (`inference/ops/moe/persistent.py`) against the Triton
decode GEMVs it replaces and the float32 reference.

Without a GPU: its shared-memory plan, and (where an NVRTC is installed) that the CUDA source
compiles for sm_90 without spilling. On a Hopper GPU: its output at real and tiny shapes, with
the fused add + norm, a padded graph row, expert parallelism, tied router logits, and many CUDA
graph replays through its grid barrier.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference.ops import nvrtc
from inference.ops.moe import persistent
from tests.benchmark_scripts import load_benchmark
from tests.inference.ops.test_moe import (
    DEVICE,
    DTYPE,
    LIMIT,
    assert_close,
    make_weights,
    prepared_copy,
    random_packed_weights,
    reference,
    triton_backend,
)
from tests.triton_interpreter import CUDA, HAVE_TRITON

HOPPER = CUDA and torch.cuda.get_device_capability() >= (9, 0) and nvrtc.available()
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs a Hopper or later GPU with NVRTC")
H200_SHARED = 232448 - 2048  # a CTA's opt-in shared memory on an H100 / H200, less the static part


def test_stage_plan_fits_gpt_oss_on_hopper():
    """gpt-oss (H = I = 2880: 23 tile pairs, top-4): a stage holds one gate_up row group (16 rows
    of 23 pairs of 64 bytes and their scale words), 8 of them beside the 4 act rows."""
    plan = persistent.stage_plan(23, 23, 4, 2944, 2944, H200_SHARED)
    assert plan.stage_bytes == 25088 and plan.stages == 8
    assert plan.shared_bytes == 8 * 25088 + 4 * 46 * 144 <= H200_SHARED
    assert persistent.stage_plan(23, 23, 4, 2944, 2944, 3 * 25088) is None  # fewer than 2 stages
    # down rows longer than gate_up's: the stage is sized by them
    assert persistent.stage_plan(2, 10, 2, 256, 1280, H200_SHARED).stage_bytes == -(-10 * 8 * 68 // 128) * 128


@pytest.mark.skipif(nvrtc._nvrtc() is None, reason="no NVRTC installed")
def test_compiles_for_sm90_without_spills():
    """The CUDA source compiles with NVRTC for the gpt-oss shapes, 20b and 120b alike; where
    triton (and its cuobjdump) is at hand, the kernel keeps everything in registers."""
    plan = persistent.stage_plan(23, 23, 4, 2944, 2944, H200_SHARED)
    defines = ("-DTOP_K=4", "-DHIDDEN=2880", "-DINTER=2880", "-DP1=23", "-DP2=23", f"-DSTAGES={plan.stages}")
    defines += (f"-DSTAGE_BYTES={plan.stage_bytes}", f"-DCONSUMER_WARPS={persistent.CONSUMER_WARPS}")
    cubin = nvrtc.compile_to_cubin(persistent.SOURCE, persistent.KERNEL, "sm_90", defines)
    assert cubin[:4] == b"\x7fELF"
    if not HAVE_TRITON:
        return
    usage = load_benchmark("kernel_resources").cubin_usage(cubin)
    assert usage["REG"] * persistent.THREADS <= 65536 and usage["STACK"] == 0 and usage["LOCAL"] == 0
    assert plan.shared_bytes + usage["SHARED"] <= H200_SHARED + 2048


def test_compile_error_carries_the_log():
    if nvrtc._nvrtc() is None:
        pytest.skip("no NVRTC installed")
    with pytest.raises(RuntimeError, match="could not compile"):
        nvrtc.compile_to_cubin('extern "C" __global__ void k() { undefined_name(); }', "k", "sm_90")


# ----------------------------------------------------------------------------- Hopper only


def _forward(w, x, top_k, on: bool, monkeypatch, **kwargs):
    monkeypatch.setattr(persistent, "_enabled", on)
    backend = triton_backend()
    return backend.forward(x, prepared_copy(backend, w), top_k, LIMIT, out_dtype=torch.float32, **kwargs)


@hopper_only
@pytest.mark.parametrize("e_count", [32, 128])
def test_real_shapes_match_the_gemvs_and_the_reference(e_count, monkeypatch):
    w = random_packed_weights(e_count, 2880, 2880, seed=30)
    for seed in range(3):
        x = torch.randn(1, 2880, generator=torch.Generator().manual_seed(seed)).to(DEVICE, DTYPE)
        fused = _forward(w, x, 4, True, monkeypatch)
        gemvs = _forward(w, x, 4, False, monkeypatch)
        assert_close(fused, reference(x, w, 4), 2e-2)
        assert_close(fused, gemvs, 5e-3)


@hopper_only
@pytest.mark.parametrize("shape", [(4, 64, 64, 2), (8, 96, 64, 4), (6, 64, 96, 3), (4, 160, 192, 2), (32, 256, 128, 4)])
def test_tiny_shapes(shape, monkeypatch):
    """One to three K tiles, down rows longer than gate_up's, fewer units than CTAs."""
    e_count, hidden, inter, top_k = shape
    w = make_weights(e_count, hidden, inter, seed=31)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    fused = _forward(w, x, top_k, True, monkeypatch)
    assert_close(fused, reference(x, w, top_k), 2e-2)
    assert_close(fused, _forward(w, x, top_k, False, monkeypatch), 5e-3)


@hopper_only
def test_add_norm_padding_row_and_expert_shares(monkeypatch):
    """With the router's add + norm; a padded graph row (valid_tokens 0) routes nowhere; two ranks'
    expert shares sum to the whole block."""
    from tests.inference.ops.test_moe import expert_share

    monkeypatch.setattr(persistent, "_enabled", True)
    w = random_packed_weights(32, 2880, 2880, seed=32)
    g = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(1, 2880, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    norm = (torch.rand(2880, generator=g) + 0.5).to(DEVICE, DTYPE)
    backend = triton_backend()
    prepared = prepared_copy(backend, w)
    residual, fused = backend.add_norm_forward(x, delta, norm, 1e-5, prepared, 4, LIMIT, out_dtype=torch.float32)
    from inference.ops.rmsnorm import add_rms_norm_reference

    want_residual, h = add_rms_norm_reference(x, delta, norm, 1e-5)
    assert torch.equal(residual, want_residual)
    assert_close(fused, reference(h, w, 4), 2e-2)

    for n in (0, 1):
        valid = torch.tensor([n], dtype=torch.int32, device=DEVICE)
        out = backend.forward(x, prepared, 4, LIMIT, out_dtype=torch.float32, valid_tokens=valid)
        if n:
            assert_close(out, reference(x, w, 4), 2e-2)
        else:
            assert torch.count_nonzero(out) == 0

    whole = backend.forward(x, prepared, 4, LIMIT, out_dtype=torch.float32)
    shares = [
        backend.forward(x, prepared_copy(backend, expert_share(w, r * 16, 16)), 4, LIMIT, out_dtype=torch.float32)
        for r in range(2)
    ]
    assert_close(sum(shares), whole, 1e-3)


@hopper_only
def test_tied_and_infinite_router_logits(monkeypatch):
    """Ties go to the lowest expert id, as in the GEMVs' top-k: with a zero router weight the
    logits are the bias, all equal (experts 0..3), or a few finite and the rest -inf."""
    w = make_weights(16, 128, 64, seed=33)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE, DTYPE)
    for bias in (torch.zeros(16), torch.tensor([float("-inf")] * 14 + [0.5, 2.0])):
        tied = dataclasses.replace(
            w, router_weight=torch.zeros_like(w.router_weight), router_bias=bias.to(DEVICE, DTYPE)
        )
        fused = _forward(tied, x, 4, True, monkeypatch)
        assert torch.isfinite(fused).all()
        assert_close(fused, _forward(tied, x, 4, False, monkeypatch), 5e-3)


@hopper_only
def test_graph_replays_through_the_grid_barrier(monkeypatch):
    """Captured once, replayed 300 times on new inputs: every replay passes the grid barrier (each
    adding one grid's arrivals to its counter) and gives the right block."""
    monkeypatch.setattr(persistent, "_enabled", True)
    w = random_packed_weights(32, 2880, 2880, seed=34)
    backend = triton_backend()
    prepared = prepared_copy(backend, w)
    x = torch.randn(1, 2880, device=DEVICE).to(DTYPE)
    backend.forward(x, prepared, 4, LIMIT)  # compile outside the capture
    barrier = persistent._barrier(x.device)
    before = barrier.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = backend.forward(x, prepared, 4, LIMIT, out_dtype=torch.float32)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(300):
        x.copy_(torch.randn(1, 2880, generator=torch.Generator().manual_seed(seed)).to(DEVICE, DTYPE))
        graph.replay()
        if seed % 60 == 0:
            assert_close(out, reference(x, w, 4), 2e-2)
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert barrier[0].item() == before[0].item() + 300 * sms


@hopper_only
def test_timeline_build_stamps_its_phases_in_order(monkeypatch):
    """The benchmarks' -DTIMELINE build (`bench_moe.py --persistent-timeline`) still computes the
    block, and its CTAs' stamps come in the kernel's order."""
    monkeypatch.setattr(persistent, "_enabled", True)
    monkeypatch.setattr(persistent, "EXTRA_DEFINES", ("-DTIMELINE",))
    w = random_packed_weights(32, 2880, 2880, seed=35)
    x = torch.randn(1, 2880, generator=torch.Generator().manual_seed(5)).to(DEVICE, DTYPE)
    backend = triton_backend()
    out = backend.forward(x, prepared_copy(backend, w), 4, LIMIT, out_dtype=torch.float32)
    assert_close(out, reference(x, w, 4), 2e-2)
    events = persistent.timeline(x.device)
    order = [
        "start",
        "past griddepcontrol.wait",
        "top-k and unit list done",
        "first bulk copy issued",
        "first unit's bytes arrived",
        "the CTA's gate_up units done",
        "grid barrier passed",
        "act in shared memory",
    ]
    medians = [events[name][0] for name in order]
    assert medians == sorted(medians) and medians[-1] < 1000  # µs
