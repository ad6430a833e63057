"""Fused residual add + RMSNorm: the Triton kernel against its pure-torch reference.

On CUDA the kernel runs for real in bf16; without CUDA a fresh process runs it under Triton's
interpreter (TRITON_INTERPRET must be set before triton is first imported) in float32.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from inference.ops.rmsnorm import add_rms_norm_reference, rms_norm_reference

CUDA = torch.cuda.is_available()
HAVE_TRITON = importlib.util.find_spec("triton") is not None

CHECK = textwrap.dedent("""
    import torch
    from inference.ops.rmsnorm import add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference

    def check(device, dtype, tol):
        g = torch.Generator().manual_seed(0)
        for t, h in [(1, 64), (5, 2880), (33, 100)]:
            x = (torch.randn(t, h, generator=g) * 3).to(device, dtype)
            d = torch.randn(t, h, generator=g).to(device, dtype)
            w = (1 + 0.1 * torch.randn(h, generator=g)).to(device, dtype)
            res, out = add_rms_norm_triton(x, d, w, 1e-5)
            ref_res, ref_out = add_rms_norm_reference(x, d, w, 1e-5)
            assert torch.equal(res, ref_res), (t, h)  # the stored residual is rounded the same way
            err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            assert err < tol, (t, h, err)
            same, normed = add_rms_norm_triton(x, None, w, 1e-5)
            assert same is x
            err = ((normed.float() - rms_norm_reference(x, w, 1e-5).float()).norm()
                   / normed.float().norm()).item()
            assert err < tol, (t, h, err)
            # Rows of a wider tensor (a strided view) read correctly.
            wide = torch.randn(t, 2 * h, generator=g).to(device, dtype)
            _, out = add_rms_norm_triton(wide[:, :h], d, w, 1e-5)
            _, ref_out = add_rms_norm_reference(wide[:, :h], d, w, 1e-5)
            assert ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item() < tol
            # A float32 delta (the MoE's own sums) is added in float32 and rounded once.
            d32 = torch.randn(t, h, generator=g).to(device)
            res, out = add_rms_norm_triton(x, d32, w, 1e-5)
            ref_res, ref_out = add_rms_norm_reference(x, d32, w, 1e-5)
            assert res.dtype == x.dtype and torch.equal(res, ref_res), (t, h)
            assert ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item() < tol
        print("ok")
""")


def test_reference_is_the_rmsnorm_of_the_sum():
    x, d, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8) + 0.5
    res, out = add_rms_norm_reference(x, d, w, 1e-5)
    s = x + d
    expected = w * s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(res, s)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rms_norm_reference(s, w, 1e-5), expected, rtol=1e-6, atol=1e-6)


def test_reference_rounds_a_float32_delta_once():
    x = torch.randn(4, 16).bfloat16()
    d = torch.randn(4, 16) * 1e-3  # small against x: rounding d to bf16 first would show
    res, _ = add_rms_norm_reference(x, d, torch.ones(16), 1e-5)
    assert res.dtype == torch.bfloat16
    assert torch.equal(res, (x.float() + d).bfloat16())


@pytest.mark.skipif(not HAVE_TRITON or CUDA, reason="needs triton (on CPU: the interpreter)")
def test_triton_kernel_matches_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = CHECK + "\ncheck('cpu', torch.float32, 1e-5)\n"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_bf16():
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["check"]("cuda", torch.bfloat16, 1e-2)
