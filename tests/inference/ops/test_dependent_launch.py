"""Programmatic dependent launch: where it is on, how kernels are launched, and (on a Hopper GPU)
that a decode layer's chain of dependent kernels in a CUDA graph reads every input only after
the kernel that writes it has finished."""

from __future__ import annotations

import pytest
import torch

from inference.ops import dependent_launch  # noqa: E402
from tests.triton_interpreter import CUDA  # (first: sets TRITON_INTERPRET on CPU)


def test_off_on_cpu_in_the_interpreter_and_when_turned_off(monkeypatch):
    assert dependent_launch.pdl_options(torch.device("cpu"), dependent=True) == {"PDL": 0}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dependent_launch.uses_pdl(torch.device("cuda"))  # decided before asking any GPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dependent_launch.set_enabled(False)
    try:
        assert dependent_launch.pdl_options(torch.device("cuda"), dependent=True) == {"PDL": 0}
    finally:
        dependent_launch.set_enabled(True)


def test_dependents_wait_and_every_kernel_lets_the_next_launch(monkeypatch):
    monkeypatch.setattr(dependent_launch, "uses_pdl", lambda device: True)
    dev = torch.device("cuda")
    wait, trigger = dependent_launch.WAIT, dependent_launch.TRIGGER
    assert dependent_launch.pdl_options(dev, dependent=True) == {"PDL": wait | trigger, "launch_pdl": True}
    assert dependent_launch.pdl_options(dev, dependent=False) == {"PDL": trigger}


needs_hopper = pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU")


@pytest.mark.gpu
@needs_hopper
def test_gpu_decode_chain_in_a_graph_matches_ordinary_launches():
    """add + norm -> qkv GEMV -> o_proj GEMV (both M = 1) -> router with add + norm -> gate_up ->
    down -> add + norm: every dependent launch in that chain, captured in one graph and replayed
    on fresh inputs, gives what the same kernels launched the ordinary way give. A dependent
    that read its input before its producer finished would see the previous replay's values."""
    from inference.ops.linear.triton import linear_triton
    from inference.ops.moe.triton import fused_add_norm_moe, prepare_moe_weights
    from inference.ops.rmsnorm import add_rms_norm_triton
    from tests.moe_layers import random_mxfp4_layer

    dev = torch.device("cuda")
    hidden, inter, q_dim, eps = 2880, 2880, 4096, 1e-5
    g = torch.Generator(device=dev).manual_seed(3)

    def randn(*shape, std=1.0, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=g, device=dev) * std).to(dtype)

    w_qkv, b_qkv = randn(q_dim + 1024, hidden, std=hidden**-0.5), randn(q_dim + 1024, std=0.02)
    w_o, b_o = randn(hidden, q_dim, std=q_dim**-0.5), randn(hidden, std=0.02)
    norm1, norm2, norm3 = (1.0 + randn(hidden, std=0.1) for _ in range(3))
    moe = prepare_moe_weights(random_mxfp4_layer(32, hidden, inter, seed=4, device=dev))
    x = randn(1, hidden)
    delta = randn(1, hidden, dtype=torch.float32)

    def layer():
        r, h = add_rms_norm_triton(x, delta, norm1, eps)
        qkv = linear_triton(h, w_qkv, b_qkv)
        attn_out = linear_triton(qkv[:, :q_dim], w_o, b_o)  # a strided view: no copy kernel between
        r2, moe_out = fused_add_norm_moe(r, attn_out, norm2, eps, moe, 4, 7.0, out_dtype=torch.float32)
        r3, h3 = add_rms_norm_triton(r2, moe_out, norm3, eps)
        return qkv, attn_out, moe_out, r3, h3

    assert dependent_launch.uses_pdl(dev)
    layer()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    for _ in range(4):
        x.copy_(randn(1, hidden))
        delta.copy_(randn(1, hidden, dtype=torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        dependent_launch.set_enabled(False)
        try:
            ordinary = layer()
        finally:
            dependent_launch.set_enabled(True)
        torch.cuda.synchronize()
        qkv, attn_out, moe_out, r3, h3 = captured
        assert torch.equal(qkv, ordinary[0]) and torch.equal(attn_out, ordinary[1])  # deterministic kernels
        # The MoE's float32 atomics add a token's experts in any order: equal up to rounding.
        torch.testing.assert_close(moe_out, ordinary[2], rtol=1e-5, atol=1e-5 * moe_out.abs().max().item())
        torch.testing.assert_close(h3.float(), ordinary[4].float(), rtol=2e-2, atol=2e-2)
