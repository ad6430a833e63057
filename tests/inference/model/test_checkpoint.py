"""Config parsing and checkpoint loading, including every error case the loader promises."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.config import ConfigError, ModelConfig
from inference.model.checkpoint import CheckpointError, CheckpointReader, expected_tensors
from inference.model.tiny_checkpoint import hf_config_dict, write_tiny_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return write_tiny_checkpoint(tmp_path / "m", seed=3)


def reader(path):
    return CheckpointReader(path, ModelConfig.from_file(path))


def test_real_20b_and_120b_shapes_parse():
    c20 = ModelConfig.from_dict(
        hf_config_dict(
            {
                "num_hidden_layers": 24,
                "num_local_experts": 32,
                "num_experts_per_tok": 4,
                "hidden_size": 2880,
                "intermediate_size": 2880,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "sliding_window": 128,
                "max_position_embeddings": 131072,
            }
        )
    )
    assert c20.layer_types[0] == "sliding_attention" and c20.layer_types[1] == "full_attention"
    assert c20.rope.factor == 32 and c20.rope.truncate is False and c20.quantized_experts
    sizes = expected_tensors(c20)
    assert sizes["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (32, 5760, 90, 16)
    c120 = ModelConfig.from_dict(
        hf_config_dict(
            {
                "num_hidden_layers": 36,
                "num_local_experts": 128,
                "num_experts_per_tok": 4,
                "hidden_size": 2880,
                "intermediate_size": 2880,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "sliding_window": 128,
            }
        )
    )
    assert c120.num_hidden_layers == 36 and len(c120.layer_types) == 36


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"layer_types": ["sliding_attention", "weird"]}, "layer_types[1]"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"model_type": "llama"}, "model_type"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
        ({"intermediate_size": 48}, "intermediate_size"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads"),  # (head_dim from the heads)
    ],
)
def test_bad_config_names_the_field(change, field):
    raw = hf_config_dict()
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)


def test_single_file_loads_memory_mapped(ckpt):
    r = reader(ckpt)
    t = r.get("model.layers.1.mlp.experts.down_proj_blocks")
    assert t.dtype == torch.uint8 and t.shape == (4, 64, 2, 16)


def test_sharded_checkpoint_loads_same_tensors(tmp_path, ckpt):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", seed=3, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = reader(ckpt), reader(sharded)
    assert len(set(b.location.values())) == 3
    for name in a.specs:
        assert torch.equal(a.get(name), b.get(name)), name


def test_bf16_expert_checkpoint_loads(tmp_path):
    from inference.model.gpt_oss import GptOssModel

    path = write_tiny_checkpoint(tmp_path / "dense", seed=4, quantized=False)
    model = GptOssModel.from_pretrained(path, device="cpu")
    assert model.layers[0].mlp.weights.experts.gate_up.shape == (4, 64, 128)


def test_missing_tensor_is_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.self_attn.sinks"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.self_attn.sinks'"):
        reader(ckpt)


def test_wrong_shape_is_named_with_file(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(5)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"'model.layers.0.self_attn.q_proj.bias' in .*model.safetensors has shape \(5,\)"
    ):
        reader(ckpt).get("model.layers.0.self_attn.q_proj.bias")


def test_wrong_dtype_is_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="gate_up_proj_scales.*dtype torch.int32, expected uint8"):
        reader(ckpt).get(name)


def test_truncated_file_is_a_clear_error(ckpt):
    from inference.model.gpt_oss import GptOssModel

    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        GptOssModel.from_pretrained(ckpt, device="cpu")


def test_shard_named_in_index_must_exist(tmp_path):
    sharded = write_tiny_checkpoint(tmp_path / "s", seed=3, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        reader(sharded)


@pytest.mark.parametrize("weight_map", [["lm_head.weight"], None, {"lm_head.weight": 3}])
def test_an_index_that_is_no_weight_map(tmp_path, weight_map):
    sharded = write_tiny_checkpoint(tmp_path / "s", seed=3, shards=2)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        reader(sharded)


def test_index_that_lies_about_a_tensor(tmp_path):
    sharded = write_tiny_checkpoint(tmp_path / "s", seed=3, shards=2)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "lm_head.weight"
    other = [f for f in set(index["weight_map"].values()) if f != index["weight_map"][name]][0]
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        reader(sharded).get(name)


def test_the_original_reference_layout_is_named(tmp_path):
    # openai/gpt-oss-*'s `original/` folder (what `hf download ... --include "original/*"` fetches)
    # holds the reference implementation's tensors, not the Hugging Face ones: say so and where
    # to point instead, not "missing tensor 'model.embed_tokens.weight' (and 36 more)".
    folder = tmp_path / "gpt-oss-20b" / "original"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "num_experts": 4,
                "experts_per_token": 2,
                "hidden_size": 64,
                "intermediate_size": 64,
                "head_dim": 16,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    save_file(
        {"embedding.weight": torch.zeros(8, 64, dtype=torch.bfloat16), "block.0.attn.sinks": torch.zeros(4)},
        str(folder / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match="original") as error:
        reader(folder)
    assert "model.embed_tokens.weight" not in str(error.value)
