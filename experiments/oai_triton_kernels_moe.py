"""A whole gpt-oss MoE layer on OpenAI's `triton_kernels` (`matmul_ogs`, the kernels vLLM runs for
gpt-oss on Hopper) against this project's Triton kernels: same random MXFP4 weights, same inputs.

`triton_kernels` is not on PyPI and is not a dependency: point `--triton-kernels` at a folder
that holds its `triton_kernels` package (triton's `python/triton_kernels`, at the release that
matches the installed Triton, or the copy vLLM wheels carry under `vllm/third_party`).

Its layer, as vLLM builds it for an SM90 GPU: the router's logits by a bf16 `F.linear`, then
`routing` (top-4, softmax over the four); `matmul_ogs` for gate_up with the fused clamped SwiGLU
(alpha 1.702, limit 7) gathering the tokens; `matmul_ogs` for down scattering and weighting
them. Weights in its Hopper MXFP4 value and scale layouts (`make_default_matmul_mxfp4_w_layout`,
scales padded to a multiple of 4 blocks), float32 biases, split-K off.

Both are timed as `benchmarks/bench_moe.py` times a backend: CUDA-graph replays over layers of
different weights, µs a layer, router included. Errors are |out - ref| / |ref| against the float32
reference (`moe_reference`, float32 router logits); the triton_kernels layer also against the
reference with bf16 router logits, which is how it routes (near-tied 4th and 5th experts swap).

    python3 experiments/oai_triton_kernels_moe.py --triton-kernels PATH [--tokens 1,256,1280,2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import (  # noqa: E402
    EXPERTS,
    HIDDEN,
    SWIGLU_LIMIT,
    TOP_K,
    float_copy,
    prepare_copy,
    random_layer,
    relative_error,
)
from cuda_timing import graph_replay_seconds  # noqa: E402

from inference.ops.moe.backend import TritonMoEBackend  # noqa: E402
from inference.ops.moe.reference import MoEWeights, moe_reference  # noqa: E402

SWIGLU_ALPHA = 1.702
LAYERS = {"20b": 3, "120b": 2}


class OaiMoELayer:
    """One layer in triton_kernels' form; `forward(x [T, H] bf16) -> [T, H]`."""

    def __init__(self, tk, layer: MoEWeights) -> None:
        self.tk = tk
        ex = layer.experts
        self.router_weight, self.router_bias = layer.router_weight, layer.router_bias
        self.w1, s1 = self._swizzle(ex.gate_up_blocks, ex.gate_up_scales)
        self.w2, s2 = self._swizzle(ex.down_blocks, ex.down_scales)
        self.b1, self.b2 = ex.gate_up_bias.float().contiguous(), ex.down_bias.float().contiguous()
        flex = tk.FlexCtx(rhs_data=tk.InFlexData())
        self.pc1 = tk.PrecisionConfig(weight_scale=s1, flex_ctx=flex)
        self.pc2 = tk.PrecisionConfig(weight_scale=s2, flex_ctx=flex)

    def _swizzle(self, blocks: torch.Tensor, scales: torch.Tensor):
        """HF blocks [E, N, K/32, 16] u8 and scales [E, N, K/32] u8 -> its Hopper layouts, K on dim 1."""
        tk = self.tk
        e, n, k_blocks, _ = blocks.shape
        values = blocks.reshape(e, n, k_blocks * 16).transpose(-2, -1)
        scales = F.pad(scales, (0, -k_blocks % 4)).transpose(-2, -1)
        value_layout, value_opts = tk.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = tk.layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        values = tk.convert_layout(tk.wrap_torch_tensor(values, dtype=tk.FP4), value_layout, **value_opts)
        scales = tk.convert_layout(tk.wrap_torch_tensor(scales), scale_layout, **scale_opts)
        return values, scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tk = self.tk
        logits = F.linear(x, self.router_weight, self.router_bias)
        routing, gather, scatter = tk.routing(logits, TOP_K, sm_first=False)
        h = tk.matmul_ogs(
            x, self.w1, self.b1, routing, gather_indx=gather, precision_config=self.pc1, fused_activation=tk.swiglu
        )
        return tk.matmul_ogs(
            h, self.w2, self.b2, routing, scatter_indx=scatter, precision_config=self.pc2, gammas=routing.gate_scal
        )


def load_triton_kernels(path: str):
    """The few names used here, from the package under `path`."""
    sys.path.insert(0, path)
    import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
    from triton_kernels import matmul_ogs, routing, tensor
    from triton_kernels.numerics import InFlexData
    from triton_kernels.swiglu_details._swiglu import _swiglu_fn
    from triton_kernels.tensor_details import layout

    opt_flags.update_opt_flags_constraints({"split_k": 1})  # as vLLM sets it on SM90
    return argparse.Namespace(
        matmul_ogs=matmul_ogs.matmul_ogs,
        FlexCtx=matmul_ogs.FlexCtx,
        PrecisionConfig=matmul_ogs.PrecisionConfig,
        InFlexData=InFlexData,
        routing=routing.routing,
        layout=layout,
        convert_layout=tensor.convert_layout,
        wrap_torch_tensor=tensor.wrap_torch_tensor,
        FP4=tensor.FP4,
        swiglu=matmul_ogs.FusedActivation(
            matmul_ogs.FnSpecs("swiglu", _swiglu_fn, ("alpha", "limit")), (SWIGLU_ALPHA, SWIGLU_LIMIT), 2
        ),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton-kernels", required=True, help="folder holding the triton_kernels package")
    ap.add_argument("--models", default="20b,120b")
    ap.add_argument("--tokens", default="1,64,128,256,352,512,1280,2048")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    tk = load_triton_kernels(args.triton_kernels)
    print("| model | tokens | ours µs | err | triton_kernels µs | err | err, bf16-logit router | ours / theirs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        compare(tk, model, [int(v) for v in args.tokens.split(",")], args.iters)
        torch.cuda.empty_cache()


def compare(tk, model: str, tokens: list[int], iters: int) -> None:
    """One model's rows of the table (its layers are freed on return)."""
    raw = [random_layer(EXPERTS[model], seed=s) for s in range(LAYERS[model])]
    backend = TritonMoEBackend()
    ours = [prepare_copy(backend, layer) for layer in raw]
    theirs = [OaiMoELayer(tk, layer) for layer in raw]

    def run_ours():
        for layer in ours:
            backend.forward(x, layer, TOP_K, SWIGLU_LIMIT)

    def run_theirs():
        for layer in theirs:
            layer.forward(x)

    for t in tokens:
        g = torch.Generator(device="cuda").manual_seed(t)
        x = (torch.randn(t, HIDDEN, generator=g, device="cuda") * 0.5).bfloat16()
        ref = moe_reference(x.float(), float_copy(raw[0]), TOP_K, SWIGLU_LIMIT)
        ref_bf16_logits = moe_reference(x, float_copy(raw[0]), TOP_K, SWIGLU_LIMIT, out_dtype=torch.float32)
        err_ours = relative_error(backend.forward(x, ours[0], TOP_K, SWIGLU_LIMIT), ref)
        out_theirs = theirs[0].forward(x)
        err_theirs, err_theirs_bf16 = relative_error(out_theirs, ref), relative_error(out_theirs, ref_bf16_logits)
        us_ours = graph_replay_seconds(run_ours, iters) / len(ours) * 1e6
        us_theirs = graph_replay_seconds(run_theirs, iters) / len(theirs) * 1e6
        print(
            f"| {model} | {t} | {us_ours:.1f} | {err_ours:.1e} | {us_theirs:.1f} | {err_theirs:.1e} | "
            f"{err_theirs_bf16:.1e} | {us_ours / us_theirs:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
