"""EAGLE-3: loading a draft checkpoint in the published layout, and the drafter inside the engine
proposing exactly what a from-scratch run of the draft head over the whole text proposes.

The from-scratch reference is written here without the engine: the target runs over the whole
text once (contiguous cache) returning its layer outputs, the draft layer runs over every
position with a fresh cache of its own, then chains k guesses. The engine instead feeds the
draft layer a few positions per step (prefill chunks, verified drafts) into paged K/V, and
rewrites positions whose drafts were rejected; both must give the same guesses.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.config import ConfigError, EngineConfig
from inference.engine.core import LLMEngine
from inference.model.gpt_oss import GptOssModel
from inference.model.rope import cos_sin_table
from inference.model.tiny_checkpoint import write_tiny_checkpoint
from inference.request import GenerationRequest, SamplingParams
from inference.runner.model_runner import build_metadata
from inference.runner.single_sequence import SingleSequenceCache
from inference.spec_decode.eagle3 import Eagle3Config, Eagle3DraftModel, write_random_eagle3_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-eagle"), seed=0)
    return GptOssModel.from_pretrained(path, device="cpu")


@pytest.fixture(scope="module")
def draft_dir(model, tmp_path_factory):
    return write_random_eagle3_checkpoint(
        tmp_path_factory.mktemp("draft"), model.config, seed=3, draft_vocab_size=512, dtype=torch.float32
    )


def test_loads_the_published_layout(model, draft_dir):
    draft = Eagle3DraftModel.from_pretrained(draft_dir, model)
    c = draft.config
    assert c.aux_layer_ids == (0, 1, 1) and c.draft_vocab_size == 512 and c.target_hidden_size == 64
    raw = load_file(str(draft_dir / "model.safetensors"))
    # q | k | v fused in that order; gate | up likewise; d2t maps draft ids to target ids.
    assert torch.equal(draft.qkv.weight[: c.num_attention_heads * c.head_dim], raw["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(draft.gate_up.weight[c.intermediate_size :], raw["midlayer.mlp.up_proj.weight"])
    assert torch.equal(draft.d2t, raw["d2t"])
    target_ids = torch.arange(512) + raw["d2t"]
    assert raw["t2d"][target_ids].all() and int(raw["t2d"].sum()) == 512
    # guess() answers in target ids, from the draft vocabulary only.
    guesses = draft.guess(torch.randn(20, 64))
    assert set(guesses.tolist()) <= set(target_ids.tolist())


def test_name_variants_and_a_shared_embedding(model, draft_dir, tmp_path):
    """`layers.0.` instead of `midlayer.`, a `model.` prefix, and no embed_tokens (the draft then
    uses the target's embedding) load to the same weights."""
    raw = load_file(str(draft_dir / "model.safetensors"))
    renamed = {
        ("model." + k.replace("midlayer.", "layers.0.")) if k != "lm_head.weight" else k: v
        for k, v in raw.items()
        if k != "embed_tokens.weight"
    }
    (tmp_path / "config.json").write_text((draft_dir / "config.json").read_text())
    save_file(renamed, str(tmp_path / "model.safetensors"))
    a = Eagle3DraftModel.from_pretrained(draft_dir, model)
    b = Eagle3DraftModel.from_pretrained(tmp_path, model)
    assert torch.equal(a.qkv.weight, b.qkv.weight) and torch.equal(a.fc.weight, b.fc.weight)
    assert b.embed is model.embed and a.embed is not model.embed


def test_bad_checkpoints_are_refused_with_the_field_named(model, draft_dir, tmp_path):
    raw = json.loads((draft_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_dict({**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, model.config)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        Eagle3Config.from_dict({**raw, "num_hidden_layers": 2}, model.config)
    with pytest.raises(ConfigError, match="target_hidden_size"):
        Eagle3Config.from_dict({**raw, "target_hidden_size": 128}, model.config)
    # Without eagle_config: the SGLang/SpecForge default layers [1, L/2 - 1, L - 4] of a 36-layer target.
    from inference.config import ModelConfig

    big = ModelConfig(
        num_hidden_layers=36,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    no_ids = {k: v for k, v in raw.items() if k != "eagle_config"}
    assert Eagle3Config.from_dict(no_ids, big).aux_layer_ids == (1, 17, 32)
    weights = load_file(str(draft_dir / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="fc.weight"):
        Eagle3DraftModel.from_pretrained(tmp_path, model)
    weights["lm_head.weight"] = weights["lm_head.weight"][:100]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="lm_head.weight"):
        Eagle3DraftModel.from_pretrained(tmp_path, model)


def test_rope_tables(model, draft_dir):
    raw = json.loads((draft_dir / "config.json").read_text())
    plain = Eagle3Config.from_dict(raw, model.config).cos_sin(64)
    d = 16
    inv = 1.0 / 150000.0 ** (torch.arange(0, d, 2).float() / d)
    assert torch.allclose(plain[5], torch.cat([(5 * inv).cos(), (5 * inv).sin()]))
    yarn = Eagle3Config.from_dict(
        {
            **raw,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        },
        model.config,
    ).cos_sin(64)
    assert torch.allclose(yarn, cos_sin_table(model.config.rope, d, 64))  # the same YaRN gpt-oss uses
    llama3 = Eagle3Config.from_dict(
        {**raw, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}},
        model.config,
    ).cos_sin(64)
    # Highest frequency unchanged, lowest slowed down by the factor.
    angle = torch.atan2(llama3[1, d // 2 :], llama3[1, : d // 2])
    assert angle[0] == pytest.approx(float(inv[0]), rel=1e-5)
    assert angle[-1] == pytest.approx(float(inv[-1]) / 8, rel=1e-4)


def reference_guesses(model, draft, text: list[int], k: int) -> list[int]:
    """The draft head's k guesses after `text`, computed from scratch (see the module docstring)."""
    n = len(text)
    cache = SingleSequenceCache(model, n)
    _, aux = model(
        torch.tensor(text[:-1]), cache.metadata(n - 1), cache.kv_caches, aux_layers=draft.config.aux_layer_ids
    )
    c = draft.config
    pages = -(-(n + k) // 4)
    kv = tuple(torch.zeros(pages, 4, c.num_key_value_heads, c.head_dim) for _ in range(2))
    table = [list(range(pages))]
    backend = model.attention_backend
    meta = build_metadata(4, table, None, [0], [n - 1], model.device)
    out = draft(torch.tensor(text[1:]), draft.fc(aux), meta, kv, backend)[-1:]
    guesses = [int(draft.guess(out))]
    for step in range(1, k):
        meta = build_metadata(4, table, None, [n - 1 + step - 1], [1], model.device)
        out = draft(torch.tensor(guesses[-1:]), out, meta, kv, backend)
        guesses.append(int(draft.guess(out)))
    return guesses


def test_engine_drafts_equal_a_from_scratch_run(model, draft_dir):
    k = 3
    eng = LLMEngine(
        model,
        EngineConfig(
            page_size=4,
            num_pages=256,
            max_num_batched_tokens=8,
            speculative="eagle3",
            draft_model=str(draft_dir),
            num_draft_tokens=k,
        ),
    )
    seen = []
    propose = eng.drafter.propose

    def recording(ctx):
        drafts = propose(ctx)
        for seq, limit, d in zip(ctx.seqs, ctx.limit, drafts):
            if limit:
                seen.append((list(seq.token_ids), limit, d))
        return drafts

    eng.drafter.propose = recording
    rng = random.Random(0)
    for i, n in enumerate([6, 13]):  # 13 tokens prefill in two chunks (budget 8)
        ids = [rng.randrange(200_000) for _ in range(n)]
        eng.add_request(GenerationRequest(str(i), ids, SamplingParams(temperature=0, max_tokens=12)))
    while eng.has_unfinished():
        eng.step()
    assert len(seen) >= 8
    for text, limit, drafts in seen:
        assert drafts == reference_guesses(model, eng.drafter.draft, text, limit)
