"""EAGLE-3 for gpt-oss: the draft head, its checkpoint format, and the drafter that runs it.

The draft head is one Llama-style decoder layer that predicts the target's next tokens from the
target's own features. At position p it reads

    f_p = fc(concat(low_p, mid_p, high_p))     the target's outputs of three layers, [3 Ht] -> [H]
    e   = embed(x_{p+1})                        the token *after* p (known once p is verified)

and computes (Llama layer whose q/k/v read 2H features, RoPE, GQA, causal attention over its own
K/V of earlier positions, SiLU MLP):

    h   = f_p + o_proj(attn(concat(input_layernorm(e), hidden_norm(f_p))))
    g_p = h + mlp(post_attention_layernorm(h))          (pre-norm output, [H])
    x_{p+2} guess = d2t-mapped argmax(lm_head(norm(g_p)))   over a reduced draft vocabulary

Chained drafting feeds g_p back in place of f at the next position: (g_p, guess) at p + 1 gives
the guess after that, and so on for k tokens. After the target verifies them, the draft layer
re-runs on the kept positions with the target's real features (overwriting its K/V there).

Its K/V live in pages of their own, indexed by the sequences' full-attention page tables (so
they need no bookkeeping: same positions, same pages; a shared prefix page also shares its
draft K/V, computed with the same tokens except that the page's last position saw the token that
followed it in the sequence that computed it, which only costs acceptance, never correctness).

Checkpoint (the published layout, e.g. lmsys/EAGLE3-gpt-oss-120b-bf16, nvidia/gpt-oss-120b-Eagle3):
config.json (architectures LlamaForCausalLMEagle3) with hidden_size, intermediate_size,
num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta / rope_scaling,
vocab_size, draft_vocab_size, optional target_hidden_size, norm_before_residual, and
eagle_config.eagle_aux_hidden_state_layer_ids: the target layers whose *outputs* are read
(SGLang / SpecForge convention; default [1, L/2 - 1, L - 4]). Tensors (safetensors, or a torch
.bin), names with or without a "model." prefix, `midlayer.` also spelled `layers.0.`:

    fc.weight [H, 3 Ht]                           norm.weight [H]
    midlayer.input_layernorm.weight [H]           midlayer.hidden_norm.weight [H]
    midlayer.self_attn.{q,k,v}_proj.weight [heads * D, 2H]   (.bias if attention_bias)
    midlayer.self_attn.o_proj.weight [H, heads * D]
    midlayer.post_attention_layernorm.weight [H]
    midlayer.mlp.{gate,up}_proj.weight [I, H]     midlayer.mlp.down_proj.weight [H, I]
    lm_head.weight [Vd, H]
    d2t [Vd] int64: target id = draft id + d2t[draft id];   t2d [V] bool (not needed here)
    embed_tokens.weight [V, H]   optional: the target's embedding when absent
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from inference.config import ConfigError, ModelConfig, RopeConfig
from inference.model.rope import cos_sin_table
from inference.runner.model_runner import build_metadata
from inference.scheduling.scheduler import SequenceStatus
from inference.spec_decode.drafter import DraftContext

# Large negative "sink" logit: the shared attention kernels then compute plain softmax attention.
NO_SINK = -1.0e30


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose outputs feed fc, low to high
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_before_residual: bool = False
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any], target: ModelConfig) -> "Eagle3Config":
        """Read a draft config.json and check it fits `target`."""
        if raw.get("num_hidden_layers", 1) != 1:
            raise ConfigError("EAGLE-3 draft config: only one decoder layer (num_hidden_layers 1) is supported")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"EAGLE-3 draft config field 'hidden_act' is {act!r}; only 'silu' is supported")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            eagle = raw.get("eagle_config") or {}
            ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
            layers = target.num_hidden_layers
            if ids is None:
                ids = [1, layers // 2 - 1, layers - 4]
            config = cls(
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                vocab_size=int(raw.get("vocab_size", target.vocab_size)),
                draft_vocab_size=int(raw.get("draft_vocab_size") or raw.get("vocab_size", target.vocab_size)),
                target_hidden_size=int(raw.get("target_hidden_size") or target.hidden_size),
                aux_layer_ids=tuple(int(i) for i in ids),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rope_scaling=raw.get("rope_scaling"),
                norm_before_residual=bool(raw.get("norm_before_residual", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"EAGLE-3 draft config is missing or has a bad field: {e}") from None
        if config.vocab_size != target.vocab_size:
            raise ConfigError(f"EAGLE-3 draft vocab_size {config.vocab_size} != the target's {target.vocab_size}")
        if config.target_hidden_size != target.hidden_size:
            raise ConfigError(
                f"EAGLE-3 draft target_hidden_size {config.target_hidden_size} != the target's {target.hidden_size}"
            )
        if len(config.aux_layer_ids) != 3 or not all(0 <= i < layers for i in config.aux_layer_ids):
            raise ConfigError(
                f"EAGLE-3 draft eagle_aux_hidden_state_layer_ids {list(config.aux_layer_ids)} must be 3 layer "
                f"indices of the target (0..{layers - 1})"
            )
        return config

    def cos_sin(self, max_positions: int, device=None) -> torch.Tensor:
        """[max_positions, head_dim] cos | sin table (the layout `rope_and_write_kv` takes)."""
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        d = self.head_dim
        if kind == "yarn":
            rope = RopeConfig(
                theta=self.rope_theta,
                factor=float(scaling.get("factor", 1.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
                beta_fast=float(scaling.get("beta_fast", 32.0)),
                beta_slow=float(scaling.get("beta_slow", 1.0)),
                truncate=bool(scaling.get("truncate", True)),
            )
            return cos_sin_table(rope, d, max_positions, device)
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        positions = torch.arange(max_positions, dtype=torch.float32)
        if kind == "linear":
            positions = positions / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind != "default":
            raise ConfigError(f"EAGLE-3 draft rope_scaling type {kind!r} is not supported")
        freqs = positions[:, None] * inv_freq[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's frequency scaling: long wavelengths slowed by `factor`, short ones kept, a
    smooth blend between (the bands set by low/high_freq_factor over the original context)."""
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    blend = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = inv_freq / factor
    return torch.where(wavelen < original / high, inv_freq, (1 - blend) * scaled + blend * inv_freq)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in float32, cast back, then scale. x: [T, H]."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Eagle3DraftModel(nn.Module):
    """The draft head (see the module docstring). Build with `from_pretrained`."""

    def __init__(self, config: Eagle3Config, target_embed: nn.Embedding | None = None):
        super().__init__()
        c = config
        self.config = config
        h, q_dim, kv_dim = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.embed = target_embed if target_embed is not None else nn.Embedding(c.vocab_size, h)
        self.fc = nn.Linear(3 * c.target_hidden_size, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.hidden_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.qkv = nn.Linear(2 * h, q_dim + 2 * kv_dim, bias=c.attention_bias)  # rows [q | k | v]
        self.o_proj = nn.Linear(q_dim, h, bias=c.attention_bias)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.gate_up = nn.Linear(h, 2 * c.intermediate_size, bias=False)  # rows [gate | up]
        self.down = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("sinks", torch.full((c.num_attention_heads,), NO_SINK))
        self.register_buffer("cos_sin", torch.zeros(0, c.head_dim), persistent=False)

    @torch.inference_mode()
    def forward(self, token_ids, features, meta, kv_cache, backend) -> torch.Tensor:
        """token_ids: [T] the token after each position; features: [T, H] fc(aux) or a previous
        step's output; meta: positions and pages (full-attention table); kv_cache: (k, v) pages.
        Returns the pre-norm outputs g [T, H]."""
        c = self.config
        t = token_ids.shape[0]
        eps = c.rms_norm_eps
        embedded = llama_rms_norm(self.embed(token_ids), self.input_layernorm, eps)
        if c.norm_before_residual:
            residual = normed = llama_rms_norm(features, self.hidden_norm, eps)
        else:
            residual, normed = features, llama_rms_norm(features, self.hidden_norm, eps)
        qkv = self.qkv(torch.cat([embedded, normed], dim=-1))
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        q = qkv[:, :q_dim].view(t, c.num_attention_heads, c.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].view(t, c.num_key_value_heads, c.head_dim)
        v = qkv[:, q_dim + kv_dim :].view(t, c.num_key_value_heads, c.head_dim)
        k_cache, v_cache = kv_cache
        out = backend.rope_kv_attention(
            q,
            k,
            v,
            self.cos_sin,
            k_cache,
            v_cache,
            meta,
            meta.block_tables["full"],
            meta.slot_mapping["full"],
            self.sinks,
            c.head_dim**-0.5,
            None,
        )
        x = residual + self.o_proj(out.reshape(t, q_dim))
        gate, up = self.gate_up(llama_rms_norm(x, self.post_attention_layernorm, eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    @torch.inference_mode()
    def guess(self, outputs: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [N, H] -> the draft's most likely next target token ids [N]."""
        best = self.lm_head(llama_rms_norm(outputs, self.norm, self.config.rms_norm_eps)).argmax(dim=-1)
        return best + self.d2t[best]

    @classmethod
    def from_pretrained(cls, path: str | Path, target, device=None, dtype=None) -> "Eagle3DraftModel":
        """Load a draft checkpoint directory for `target` (a GptOssModel); device/dtype default to the target's."""
        path = Path(path)
        try:
            raw = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json in the EAGLE-3 draft directory {path}") from None
        config = Eagle3Config.from_dict(raw, target.config)
        device, dtype = device or target.device, dtype or target.dtype
        tensors = {_canonical(name): t for name, t in _read_tensors(path).items()}
        shared = "embed_tokens.weight" not in tensors
        if shared and config.hidden_size != target.config.hidden_size:
            raise ConfigError("the EAGLE-3 draft has no embed_tokens and its hidden_size differs from the target's")
        with torch.device("meta"):
            model = cls(config)
        if shared:
            model.embed = target.embed
        _load(model, tensors, config, device, dtype)
        model.cos_sin = config.cos_sin(target.max_positions, device)
        return model.eval()


def _canonical(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model.") :]
    return name.replace("midlayer.", "layers.0.")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        return tensors
    bins = sorted(path.glob("*.bin"))
    if bins:
        tensors = {}
        for f in bins:
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
        return tensors
    raise ConfigError(f"no *.safetensors or *.bin weights in the EAGLE-3 draft directory {path}")


def _load(model: Eagle3DraftModel, tensors: dict[str, torch.Tensor], c: Eagle3Config, device, dtype) -> None:
    h, q_dim, kv_dim = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    expected = {
        "fc.weight": (h, 3 * c.target_hidden_size),
        "layers.0.input_layernorm.weight": (h,),
        "layers.0.hidden_norm.weight": (h,),
        "layers.0.self_attn.q_proj.weight": (q_dim, 2 * h),
        "layers.0.self_attn.k_proj.weight": (kv_dim, 2 * h),
        "layers.0.self_attn.v_proj.weight": (kv_dim, 2 * h),
        "layers.0.self_attn.o_proj.weight": (h, q_dim),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (c.intermediate_size, h),
        "layers.0.mlp.up_proj.weight": (c.intermediate_size, h),
        "layers.0.mlp.down_proj.weight": (h, c.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
    }
    if "embed_tokens.weight" in tensors:
        expected["embed_tokens.weight"] = (c.vocab_size, h)
    if c.attention_bias:
        expected.update(
            {
                f"layers.0.self_attn.{n}_proj.bias": (size,)
                for n, size in (("q", q_dim), ("k", kv_dim), ("v", kv_dim), ("o", h))
            }
        )
    for name, shape in expected.items():
        if name not in tensors:
            raise ConfigError(f"the EAGLE-3 draft checkpoint has no tensor {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise ConfigError(f"EAGLE-3 draft tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")

    def param(*names: str) -> nn.Parameter:
        t = torch.cat([tensors[n] for n in names]) if len(names) > 1 else tensors[names[0]]
        return nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

    a, m = "layers.0.self_attn.", "layers.0.mlp."
    model.fc.weight = param("fc.weight")
    model.input_layernorm = param("layers.0.input_layernorm.weight")
    model.hidden_norm = param("layers.0.hidden_norm.weight")
    model.qkv.weight = param(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
    model.o_proj.weight = param(a + "o_proj.weight")
    if c.attention_bias:
        model.qkv.bias = param(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        model.o_proj.bias = param(a + "o_proj.bias")
    model.post_attention_layernorm = param("layers.0.post_attention_layernorm.weight")
    model.gate_up.weight = param(m + "gate_proj.weight", m + "up_proj.weight")
    model.down.weight = param(m + "down_proj.weight")
    model.norm = param("norm.weight")
    model.lm_head.weight = param("lm_head.weight")
    if "embed_tokens.weight" in tensors:
        model.embed = nn.Embedding(c.vocab_size, h, device=device, dtype=dtype)
        model.embed.weight = param("embed_tokens.weight")
    d2t = tensors.get("d2t")
    if d2t is None:
        if c.draft_vocab_size != c.vocab_size:
            raise ConfigError("the EAGLE-3 draft has a reduced vocabulary but no d2t mapping")
        d2t = torch.zeros(c.draft_vocab_size, dtype=torch.long)
    if tuple(d2t.shape) != (c.draft_vocab_size,):
        raise ConfigError(f"EAGLE-3 draft tensor 'd2t' has shape {tuple(d2t.shape)}, expected ({c.draft_vocab_size},)")
    model.d2t = d2t.to(device=device, dtype=torch.long)
    model.sinks = torch.full((c.num_attention_heads,), NO_SINK, device=device)


class Eagle3Drafter:
    """Runs an `Eagle3DraftModel` next to the target inside the engine (see `speculative.Drafter`)."""

    writes_ahead = True

    def __init__(self, draft: Eagle3DraftModel, target):
        self.draft = draft
        self.target = target
        self.aux_layers = draft.config.aux_layer_ids
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.page_size = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, target) -> "Eagle3Drafter":
        return cls(Eagle3DraftModel.from_pretrained(path, target), target)

    def kv_bytes_per_page(self, page_size: int) -> int:
        c = self.draft.config
        return 2 * page_size * c.num_key_value_heads * c.head_dim * self.target.dtype.itemsize

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        c = self.draft.config
        shape = (num_pages, page_size, c.num_key_value_heads, c.head_dim)
        dev, dtype = self.target.device, self.target.dtype
        self.kv_cache = (torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
        self.page_size = page_size

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in ctx.seqs]
        live = (SequenceStatus.RUNNING, SequenceStatus.PARKED)
        entries = [i for i, seq in enumerate(ctx.seqs) if ctx.num_kept[i] > 0 and seq.status in live]
        if not entries or ctx.aux_hidden is None:
            return drafts
        dev = self.target.device
        backend = self.target.attention_backend
        # 1. The kept positions, with the target's features: this writes the draft K/V there and
        #    gives the first guess from each sequence's last kept position.
        starts = [ctx.start[i] for i in entries]
        counts = [ctx.num_kept[i] for i in entries]
        rows = torch.tensor([ctx.first_row[i] + j for i, n in zip(entries, counts) for j in range(n)], device=dev)
        # Position p pairs the target's features at p with the token after it.
        next_tokens = [t for i, s, n in zip(entries, starts, counts) for t in ctx.seqs[i].token_ids[s + 1 : s + 1 + n]]
        meta = build_metadata(self.page_size, [ctx.seqs[i].pages.full for i in entries], None, starts, counts, dev)
        features = self.draft.fc(ctx.aux_hidden[rows])
        outputs = self.draft(torch.tensor(next_tokens, device=dev), features, meta, self.kv_cache, backend)
        ends = torch.tensor(counts, device=dev).cumsum(0) - 1
        active = [j for j, i in enumerate(entries) if ctx.limit[i] > 0]
        if not active:
            return drafts
        outputs = outputs[ends[active]]
        active = [entries[j] for j in active]
        guesses = self.draft.guess(outputs)
        # 2. Chain: each guess and the output that made it give the next guess, one position on.
        step = 0
        while True:
            for i, token in zip(active, guesses.tolist()):
                drafts[i].append(token)
            step += 1
            keep = [j for j, i in enumerate(active) if ctx.limit[i] > step]
            if not keep:
                return drafts
            index = torch.tensor(keep, device=dev)
            active = [active[j] for j in keep]
            positions = [ctx.start[i] + ctx.num_kept[i] + step - 1 for i in active]
            meta = build_metadata(
                self.page_size, [ctx.seqs[i].pages.full for i in active], None, positions, [1] * len(active), dev
            )
            outputs = self.draft(guesses[index], outputs[index], meta, self.kv_cache, backend)
            guesses = self.draft.guess(outputs)


def write_random_eagle3_checkpoint(
    path: str | Path,
    target: ModelConfig,
    *,
    seed: int = 0,
    draft_vocab_size: int = 4096,
    aux_layer_ids: list[int] | None = None,
    draft_token_ids: list[int] | None = None,
    with_embedding: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    **overrides: Any,
) -> Path:
    """A random EAGLE-3 draft for `target` in the published layout (SpecForge names: `midlayer.`),
    for tests. The draft vocabulary is `draft_token_ids` (target ids) or a random subset of the
    target's, `draft_vocab_size` tokens either way."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    h = target.hidden_size
    layers = target.num_hidden_layers
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": target.rope.theta,
        "rope_scaling": None,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids or [0, layers // 2, layers - 1]},
        **overrides,
    }
    c = Eagle3Config.from_dict(raw, target)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    q_dim, kv_dim, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    ones = torch.ones(h, dtype=dtype)
    w = {
        "fc.weight": randn(h, 3 * h, std=(3 * h) ** -0.5),
        "midlayer.input_layernorm.weight": ones.clone(),
        "midlayer.hidden_norm.weight": ones.clone(),
        "midlayer.self_attn.q_proj.weight": randn(q_dim, 2 * h, std=1.5 * (2 * h) ** -0.5),
        "midlayer.self_attn.k_proj.weight": randn(kv_dim, 2 * h, std=1.5 * (2 * h) ** -0.5),
        "midlayer.self_attn.v_proj.weight": randn(kv_dim, 2 * h, std=(2 * h) ** -0.5),
        "midlayer.self_attn.o_proj.weight": randn(h, q_dim, std=q_dim**-0.5),
        "midlayer.post_attention_layernorm.weight": ones.clone(),
        "midlayer.mlp.gate_proj.weight": randn(inter, h, std=h**-0.5),
        "midlayer.mlp.up_proj.weight": randn(inter, h, std=h**-0.5),
        "midlayer.mlp.down_proj.weight": randn(h, inter, std=inter**-0.5),
        "norm.weight": ones.clone(),
        "lm_head.weight": randn(draft_vocab_size, h, std=h**-0.5),
    }
    if with_embedding:
        w["embed_tokens.weight"] = randn(target.vocab_size, h, std=1.0)
    if draft_token_ids is not None:
        target_ids = torch.tensor(sorted(draft_token_ids))
    else:
        target_ids = torch.randperm(target.vocab_size, generator=g)[:draft_vocab_size].sort().values
    if len(target_ids) != draft_vocab_size:
        raise ValueError("draft_token_ids must hold draft_vocab_size ids")
    w["d2t"] = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    w["t2d"] = t2d
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
