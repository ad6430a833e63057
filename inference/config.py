"""The gpt-oss model configuration, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")


class ConfigError(ValueError):
    """A config.json value is missing, of the wrong type, or inconsistent; the message names it."""


@dataclass(frozen=True)
class RopeConfig:
    """YaRN rotary embedding parameters (docs/design.md §1)."""

    theta: float = 150000.0
    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = False


# The released models' shapes (docs/design.md §1) as config.json fields, for benchmarks and tests that
# build random-weight models of the real size (`ModelConfig.from_dict(hf_config_dict(...))`).
_GPT_OSS_COMMON = dict(
    num_experts_per_tok=4,
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=201088,
    sliding_window=128,
    max_position_embeddings=131072,
)
GPT_OSS_SHAPES: dict[str, dict[str, Any]] = {
    "20b": dict(_GPT_OSS_COMMON, num_hidden_layers=24, num_local_experts=32),
    "120b": dict(_GPT_OSS_COMMON, num_hidden_layers=36, num_local_experts=128),
}


@dataclass(frozen=True)
class ModelConfig:
    num_hidden_layers: int = 24
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    sliding_window: int = 128
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rope: RopeConfig = field(default_factory=RopeConfig)
    layer_types: tuple[str, ...] = ()
    quantized_experts: bool = True  # quantization_config.quant_method == "mxfp4"

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(
                self,
                "layer_types",
                tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)),
            )
        self.validate()

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def validate(self) -> None:
        positive = [
            "num_hidden_layers",
            "num_local_experts",
            "num_experts_per_tok",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "sliding_window",
            "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config field 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(
                f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                f"num_local_experts ({self.num_local_experts})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config field 'head_dim' must be even for rotary embeddings, got {self.head_dim}")
        if self.quantized_experts:
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % 32:
                    raise ConfigError(f"config field '{name}' must be a multiple of 32 for MXFP4 experts")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config field 'layer_types' has {len(self.layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"config field 'layer_types[{i}]' is {kind!r}, expected one of {LAYER_TYPES}")
        if self.rms_norm_eps <= 0:
            raise ConfigError("config field 'rms_norm_eps' must be > 0")
        if self.rope.factor < 1:
            raise ConfigError("config field 'rope_scaling.factor' must be >= 1")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed HF config.json. Unknown keys are ignored; known ones are checked."""
        model_type = raw.get("model_type", "gpt_oss")
        if model_type != "gpt_oss":
            raise ConfigError(f"config field 'model_type' is {model_type!r}, expected 'gpt_oss'")
        kwargs: dict[str, Any] = {}
        int_fields = [
            "num_hidden_layers",
            "num_local_experts",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "sliding_window",
            "max_position_embeddings",
        ]
        for name in int_fields:
            if name in raw:
                kwargs[name] = _int(raw, name)
        # Older exports call it experts_per_token.
        if "num_experts_per_tok" in raw:
            kwargs["num_experts_per_tok"] = _int(raw, "num_experts_per_tok")
        elif "experts_per_token" in raw:
            kwargs["num_experts_per_tok"] = _int(raw, "experts_per_token")
        if "head_dim" not in raw and "hidden_size" in raw and kwargs.get("num_attention_heads", 0) > 0:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]  # (0 heads: refused below)
        for name in ("rms_norm_eps", "swiglu_limit"):
            if name in raw:
                kwargs[name] = _float(raw, name)
        if "layer_types" in raw and raw["layer_types"] is not None:
            if not isinstance(raw["layer_types"], list):
                raise ConfigError("config field 'layer_types' must be a list")
            kwargs["layer_types"] = tuple(raw["layer_types"])
        kwargs["rope"] = _rope(raw)
        quant = raw.get("quantization_config")
        if quant is None:
            kwargs["quantized_experts"] = False
        else:
            method = quant.get("quant_method") if isinstance(quant, dict) else None
            if method != "mxfp4":
                raise ConfigError(
                    f"config field 'quantization_config.quant_method' is {method!r}; only 'mxfp4' is supported"
                )
            kwargs["quantized_experts"] = True
        if raw.get("tie_word_embeddings"):
            raise ConfigError("config field 'tie_word_embeddings' must be false for gpt-oss (untied lm_head)")
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(raw)


def _int(raw: dict, name: str) -> int:
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field '{name}' must be an integer, got {value!r}")
    return value


def _float(raw: dict, name: str) -> float:
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config field '{name}' must be a number, got {value!r}")
    return float(value)


def _rope(raw: dict) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); older files rope_scaling + rope_theta.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise ConfigError(f"config field '{key}' must be an object")
    rope_type = params.get("rope_type", params.get("type", "yarn"))
    if rope_type != "yarn":
        raise ConfigError(f"config field '{key}.rope_type' is {rope_type!r}; gpt-oss uses 'yarn'")
    theta = params.get("rope_theta", raw.get("rope_theta", 150000.0))
    try:
        return RopeConfig(
            theta=float(theta),
            factor=float(params.get("factor", 32.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 4096)),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
            truncate=bool(params.get("truncate", False)),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config field '{key}' has a bad value: {e}") from None


# The drafters speculative decoding can use (`inference/spec_decode/`).
SPECULATIVE_METHODS = ("ngram", "eagle3")
# The choices of `EngineConfig.tp_all_reduce` and `moe_parallel` (what they mean:
# `inference/distributed/group.py`, `inference/distributed/sharding.py`).
TP_ALL_REDUCE_MODES = ("auto", "symm_mem", "nccl", "none")
MOE_PARALLEL_MODES = ("tensor", "expert")
# What `EngineConfig.kv_cache_dtype` takes: "auto" stores keys and values in the model's dtype,
# "fp8" in float8 e4m3 (`inference/ops/attention/reference.py`, `cache_values`).
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass
class EngineConfig:
    """Engine options (the model's own ones, device/dtype/backends, go to `from_pretrained`).

    KV cache size: `num_pages` (full-attention pages) if given; else on CUDA a share
    `gpu_memory_utilization` of the GPU's memory minus what the model and one largest step
    need; else (CPU) `kv_cache_memory` bytes. `num_sliding_pages` overrides the sliding pool.

    Speculative decoding (`inference/spec_decode/drafters.py`): `speculative` "ngram" or "eagle3" proposes
    up to `num_draft_tokens` tokens per step for the target to verify; eagle3 reads its draft
    head from `draft_model` (a checkpoint directory).

    `tensor_parallel_size` N > 1 splits the model over N GPUs, one process each
    (`inference/engine/executor.py`); this process stays rank 0 and runs the scheduler. Then
    `tp_all_reduce` says how partial sums are all-reduced ("auto": peer memory for decode-sized
    messages, NCCL for the rest; "symm_mem": the same, an error without peer memory; "nccl";
    "none", for measurements only: see `inference/distributed/group.py`), `moe_parallel` how
    the MoE is split ("tensor": every expert's columns; "expert": whole experts, see
    `inference/distributed/sharding.py`), and `tp_step_timeout` how many seconds a step may go
    unfinished on a worker before the engine fails (a hung rank; a stopped or dead one fails it
    within seconds).

    `kv_cache_dtype` "fp8" stores keys and values as float8 e4m3 (one byte each, saturating at
    ±448, no scale): twice the tokens in the same memory and half the bytes decode attention
    reads, for keys and values rounded to 4 significant bits (docs/design.md). "auto": the
    model's dtype.

    `async_scheduling` launches each step (prompts joining included) before the previous one's
    tokens are read (`inference/scheduling/async_scheduling.py`); None: on CUDA only. Never with
    a drafter or tensor parallelism.
    """

    page_size: int = 16
    num_pages: int | None = None
    num_sliding_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int = 512 << 20
    # Sequences in one batch. 512 measured best on an H200 (docs/benchmark-log.md, "max_num_seqs
    # 512 by default"): with 512 clients, 256 slots left half of them queued (20b: median TTFT
    # 15.2 s against 3.0, 16,315 against 17,192 output tok/s; 120b 6,379 against 7,891). Fewer
    # clients than slots run the same batches either way.
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 8192
    # While sequences decode, prefill takes at most this many tokens a step (None: the whole
    # budget): bounds the step a joining prompt adds to every running stream's inter-token time.
    max_prefill_tokens_decoding: int | None = 1024
    max_model_len: int | None = None
    enforce_eager: bool = False  # no CUDA graphs
    speculative: str | None = None
    num_draft_tokens: int = 4
    draft_model: str | None = None
    tensor_parallel_size: int = 1
    tp_all_reduce: str = "auto"
    moe_parallel: str = "tensor"
    tp_step_timeout: float = 30.0
    async_scheduling: bool | None = None
    kv_cache_dtype: str = "auto"

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError("page_size must be a power of two")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("num_pages", "num_sliding_pages", "max_model_len", "max_prefill_tokens_decoding"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.speculative is not None:
            if self.speculative not in SPECULATIVE_METHODS:
                raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}")
            if self.num_draft_tokens < 1:
                raise ValueError("num_draft_tokens must be >= 1")
            if self.speculative == "eagle3" and not self.draft_model:
                raise ValueError("speculative eagle3 needs draft_model (an EAGLE-3 checkpoint directory)")
        if (
            isinstance(self.tensor_parallel_size, bool)
            or not isinstance(self.tensor_parallel_size, int)
            or self.tensor_parallel_size < 1
        ):
            raise ValueError("tensor_parallel_size must be an integer >= 1")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError("async_scheduling must be true, false or unset")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.tp_all_reduce not in TP_ALL_REDUCE_MODES:
            raise ValueError(f"tp_all_reduce must be one of {', '.join(TP_ALL_REDUCE_MODES)}")
        if self.moe_parallel not in MOE_PARALLEL_MODES:
            raise ValueError(f"moe_parallel must be one of {', '.join(MOE_PARALLEL_MODES)}")
        if (
            isinstance(self.tp_step_timeout, bool)
            or not isinstance(self.tp_step_timeout, (int, float))
            or not self.tp_step_timeout > 0
        ):
            raise ValueError("tp_step_timeout must be a number of seconds > 0")
        if self.tensor_parallel_size > 1 and self.speculative == "eagle3":
            raise ValueError("speculative eagle3 does not run with tensor_parallel_size > 1 (ngram does)")
