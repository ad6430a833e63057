"""Our gpt-oss against transformers' GptOssForCausalLM on the same random checkpoint.

Both run in float32 on CPU. Tolerance: max |ours - hf| <= ATOL on the logits (observed ~5e-6 on
logits of magnitude ~5). Each of the model's distinctive features is then broken on purpose and
the comparison must fail, which shows the tolerance is tight enough to catch it.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from inference.config import RopeConfig  # noqa: E402
from inference.model.gpt_oss import GptOssModel  # noqa: E402
from inference.model.rope import cos_sin_table  # noqa: E402
from inference.model.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from inference.ops.moe import reference as moe_module  # noqa: E402
from inference.runner.single_sequence import SingleSequenceCache  # noqa: E402

ATOL = 1e-4

CONFIGS = {
    # Default tiny shape: 2 layers (sliding, full), window 8, GQA 2, 4 experts top-2.
    "tiny-a": dict(seed=0),
    # Another shape: 3 layers, 8 heads over 2 KV heads (GQA 4), head_dim 32, 8 experts top-4, window 5.
    "tiny-b": dict(
        seed=1,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        hidden_size=96,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=5,
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return write_tiny_checkpoint(path, **CONFIGS[request.param])


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import GptOssForCausalLM, Mxfp4Config

    return GptOssForCausalLM.from_pretrained(
        checkpoint,
        quantization_config=Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()


@pytest.fixture(scope="module")
def prompt():
    # 27 tokens: longer than either sliding window, not a multiple of the page size.
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 200_000, (27,), generator=g).tolist()


def hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def our_logits(model, ids, prefill: int, page_size: int = 4):
    """Prefill `prefill` tokens in one step, then feed the rest one token per step."""
    cache = SingleSequenceCache(model, len(ids), page_size=page_size)
    rows = [cache.forward(ids[:prefill])]
    for token in ids[prefill:]:
        rows.append(cache.forward([token]))
    return torch.cat(rows)


def load_ours(checkpoint):
    return GptOssModel.from_pretrained(checkpoint, device="cpu", dtype=torch.float32)


def test_prefill_logits_match_transformers(checkpoint, hf_model, prompt):
    ref = hf_logits(hf_model, prompt)
    ours = our_logits(load_ours(checkpoint), prompt, prefill=len(prompt))
    assert (ours - ref).abs().max().item() <= ATOL


def test_decode_logits_match_transformers(checkpoint, hf_model, prompt):
    ref = hf_logits(hf_model, prompt)
    ours = our_logits(load_ours(checkpoint), prompt, prefill=3)
    assert (ours - ref).abs().max().item() <= ATOL


def test_greedy_generation_matches_transformers(checkpoint, hf_model, prompt):
    from inference.runner.single_sequence import generate

    ours = generate(load_ours(checkpoint), prompt[:10], max_new_tokens=12)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt[:10]]), max_new_tokens=12, do_sample=False)
    assert ours == out[0, 10:].tolist()


def _mismatch(checkpoint, hf_model, prompt, break_model) -> float:
    model = load_ours(checkpoint)
    break_model(model)
    ref = hf_logits(hf_model, prompt)
    return (our_logits(model, prompt, prefill=len(prompt)) - ref).abs().max().item()


def _drop_sinks(model):
    for block in model.layers:
        block.attn.sinks.fill_(float("-inf"))


def _drop_window(model):
    for block in model.layers:
        block.attn.window = None


def _drop_yarn(model):
    c = model.config
    plain = RopeConfig(theta=c.rope.theta, factor=1.0)
    model.cos_sin = cos_sin_table(plain, c.head_dim, model.max_positions)


def _split_gate_up(monkeypatch):
    def halves_swiglu(h, limit, alpha=1.702):
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)

    monkeypatch.setattr(moe_module, "swiglu", halves_swiglu)


@pytest.mark.parametrize("feature", ["sinks", "sliding window", "yarn scaling", "gate/up interleave"])
def test_tolerance_catches_each_feature(feature, checkpoint, hf_model, prompt, monkeypatch):
    breakers = {"sinks": _drop_sinks, "sliding window": _drop_window, "yarn scaling": _drop_yarn}
    if feature == "gate/up interleave":
        _split_gate_up(monkeypatch)
        breaker = lambda model: None  # noqa: E731
    else:
        breaker = breakers[feature]
    assert _mismatch(checkpoint, hf_model, prompt, breaker) > 100 * ATOL
