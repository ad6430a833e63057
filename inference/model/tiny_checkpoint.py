"""Tiny random gpt-oss checkpoints in exactly the Hugging Face layout.

Used by the tests (our model and transformers' load the same directory) and by
`oss-agent serve` when no model is given. The weights are random, so the text is noise; the
vocabulary is the real one (201088 tokens) so Harmony rendering works unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from inference.config import ModelConfig
from inference.ops.mxfp4 import quantize_mxfp4

TINY_DEFAULTS: dict[str, Any] = dict(
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=201088,
    sliding_window=8,
    max_position_embeddings=4096,
)


def hf_config_dict(overrides: dict[str, Any] | None = None, quantized: bool = True) -> dict[str, Any]:
    """A config.json body as transformers writes it for gpt-oss."""
    values = {**TINY_DEFAULTS, **(overrides or {})}
    n = values["num_hidden_layers"]
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        **values,
    }
    if quantized:
        config["quantization_config"] = {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        }
    return config


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random tensors for every checkpoint entry, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    c = config
    h, i, e = c.hidden_size, c.intermediate_size, c.num_local_experts
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": randn(c.vocab_size, h),
        "model.norm.weight": (1 + randn(h, std=0.1).float()).to(dtype),
        "lm_head.weight": randn(c.vocab_size, h, std=h**-0.5),
    }
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        # Large enough q/k that attention is far from uniform, so masking and sinks matter.
        w.update(
            {
                p + "input_layernorm.weight": (1 + randn(h, std=0.1).float()).to(dtype),
                p + "post_attention_layernorm.weight": (1 + randn(h, std=0.1).float()).to(dtype),
                p + "self_attn.q_proj.weight": randn(q_dim, h, std=1.5 * h**-0.5),
                p + "self_attn.q_proj.bias": randn(q_dim, std=0.1),
                p + "self_attn.k_proj.weight": randn(kv_dim, h, std=1.5 * h**-0.5),
                p + "self_attn.k_proj.bias": randn(kv_dim, std=0.1),
                p + "self_attn.v_proj.weight": randn(kv_dim, h, std=h**-0.5),
                p + "self_attn.v_proj.bias": randn(kv_dim, std=0.1),
                p + "self_attn.o_proj.weight": randn(h, q_dim, std=q_dim**-0.5),
                p + "self_attn.o_proj.bias": randn(h, std=0.1),
                p + "self_attn.sinks": randn(c.num_attention_heads, std=1.0),
                p + "mlp.router.weight": randn(e, h, std=h**-0.5),
                p + "mlp.router.bias": randn(e, std=0.1),
                p + "mlp.experts.gate_up_proj_bias": randn(e, 2 * i, std=0.1),
                p + "mlp.experts.down_proj_bias": randn(e, h, std=0.1),
            }
        )
        # Stored [E, out, in] for MXFP4 and [E, in, out] dense, as HF does.
        gate_up = torch.randn(e, 2 * i, h, generator=g) * (2.0 * h**-0.5)
        down = torch.randn(e, h, i, generator=g) * (i**-0.5)
        if c.quantized_experts:
            blocks, scales = quantize_mxfp4(gate_up)
            w[p + "mlp.experts.gate_up_proj_blocks"], w[p + "mlp.experts.gate_up_proj_scales"] = blocks, scales
            blocks, scales = quantize_mxfp4(down)
            w[p + "mlp.experts.down_proj_blocks"], w[p + "mlp.experts.down_proj_scales"] = blocks, scales
        else:
            w[p + "mlp.experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous().to(dtype)
            w[p + "mlp.experts.down_proj"] = down.transpose(1, 2).contiguous().to(dtype)
    return w


def write_tiny_checkpoint(
    path: str | Path, seed: int = 0, quantized: bool = True, shards: int = 1, **overrides: Any
) -> Path:
    """Write config.json and safetensors (sharded with an index when shards > 1). Returns path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = hf_config_dict(overrides, quantized=quantized)
    config = ModelConfig.from_dict(raw)
    weights = random_weights(config, seed=seed)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    names = list(weights)
    if shards <= 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
        "weight_map": weight_map,
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def default_tiny_checkpoint(seed: int = 0) -> Path:
    """The tiny checkpoint served when no model is given, written once into the user's cache.

    `$OSS_AGENT_CACHE` (default `~/.cache/oss-agent`) holds it; a half-written one is rewritten.
    """
    import os

    root = Path(os.environ.get("OSS_AGENT_CACHE", Path.home() / ".cache" / "oss-agent"))
    path = root / f"tiny-gpt-oss-seed{seed}"
    done = path / ".complete"
    if not done.is_file():
        write_tiny_checkpoint(path, seed=seed)
        done.write_text("ok\n")
    return path
