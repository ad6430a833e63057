"""gpt-oss, the model itself, written to mirror docs/design.md §1.

One forward call processes a flat, ragged batch of new tokens (any mix of prefill chunks and
decode tokens) against a paged KV cache; see `inference/ops/attention/reference.py` for the step metadata.
Attention and MoE math go through swappable backends (pure torch reference on CPU, Triton or
flashinfer kernels on GPU) so the model code stays the same everywhere.

    x = embed(tokens)
    for each layer:  x += attn(rmsnorm(x));  x += moe(rmsnorm(x))
    logits = lm_head(rmsnorm(x))
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from inference.config import ModelConfig
from inference.distributed.sharding import local_config, slice_of
from inference.model.checkpoint import CheckpointReader, expected_tensors
from inference.model.rope import cos_sin_table
from inference.ops.attention.backend import select_attention_backend, triton_available
from inference.ops.attention.reference import AttentionMetadata
from inference.ops.linear.backend import DecodeLinear, use_decode_gemv
from inference.ops.moe.backend import model_output_dtype, select_moe_backend
from inference.ops.moe.reference import ExpertWeights, MoEWeights
from inference.ops.rmsnorm import add_rms_norm_reference, rms_norm_reference

log = logging.getLogger(__name__)


def select_add_rms_norm(device: torch.device):
    """`add_rms_norm(x, delta, weight, eps) -> (x + delta, rms_norm(x + delta))` for `device`
    (delta may be None): the fused Triton kernel on CUDA, the pure-torch reference elsewhere."""
    if triton_available(torch.device(device)):
        from inference.ops.rmsnorm import add_rms_norm_triton

        return add_rms_norm_triton

    def add_rms_norm(x, delta, weight, eps):
        if delta is None:
            return x, rms_norm_reference(x, weight, eps)
        return add_rms_norm_reference(x, delta, weight, eps)

    return add_rms_norm


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp=None):
        """config: this rank's layer shapes (its heads under tensor parallelism); tp: the group
        whose ranks' partial outputs are summed, None on one device."""
        super().__init__()
        c = config
        self.layer = layer
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.window = c.sliding_window if c.is_sliding(layer) else None
        self.cache_kind = "sliding" if c.is_sliding(layer) else "full"
        self.sm_scale = c.sm_scale
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        # q, k and v in one matmul: rows [q | k | v]. On CUDA the loaders turn o_proj into a
        # `decode_linear.DecodeLinear` (same math; decode-sized batches run a Triton GEMV).
        self.qkv = nn.Linear(c.hidden_size, q_dim + 2 * kv_dim, bias=True)
        self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.zeros(c.num_attention_heads, dtype=torch.float32), requires_grad=False)

    def forward(self, x, meta: AttentionMetadata, kv_cache, cos_sin, backend) -> torch.Tensor:
        t = x.shape[0]
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(x)
        q = qkv[:, :q_dim].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_dim + kv_dim :].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        kind = self.cache_kind
        out = backend.rope_kv_attention(
            q,
            k,
            v,
            cos_sin,
            k_cache,
            v_cache,
            meta,
            meta.block_tables[kind],
            meta.slot_mapping[kind],
            self.sinks,
            self.sm_scale,
            self.window,
        )
        out = out.reshape(t, q_dim)
        if self.tp is None:
            return self.o_proj(out)
        # This rank's heads' share of o_proj, summed over the ranks (float32 at decode: see
        # `inference/distributed/group.py`); the residual add takes the sum as it is.
        dtype = self.tp.reduce_dtype(t, x.dtype)
        partial = self.o_proj(out, out_dtype=dtype) if isinstance(self.o_proj, DecodeLinear) else self.o_proj(out)
        return self.tp.all_reduce(partial.to(dtype))


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, tp=None):
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.limit = config.swiglu_limit
        self.weights: MoEWeights | None = None  # raw weights as loaded
        self.prepared = None  # the backend's layout of them

    def forward(self, x: torch.Tensor, backend, valid_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] normed hidden states -> [T, H]: float32 on one device where the backend
        computes in float32 (the residual add takes it as it is, see `inference.ops.moe.backend`),
        otherwise x's dtype; under tensor parallelism the sum of the ranks' partial outputs, in
        `reduce_dtype` (float32 at decode). valid_tokens: the real rows of a padded step
        (`GptOssModel.forward`)."""
        out = backend.forward(
            x, self.prepared, self.top_k, self.limit, out_dtype=self._out_dtype(x, backend), valid_tokens=valid_tokens
        )
        return out if self.tp is None else self.tp.all_reduce(out)

    def add_norm_forward(self, x, delta, norm_weight, eps, backend, add_rms_norm, valid_tokens=None):
        """(x + delta, forward(rmsnorm(x + delta) * norm_weight)): the residual add and norm in
        the backend's own kernels where it has them (one launch fewer a layer at decode; under
        tensor parallelism delta is the all-reduced attention output, float32 at decode)."""
        fused = getattr(backend, "add_norm_forward", None)
        if fused is not None:
            result = fused(
                x,
                delta,
                norm_weight,
                eps,
                self.prepared,
                self.top_k,
                self.limit,
                out_dtype=self._out_dtype(x, backend),
                valid_tokens=valid_tokens,
            )
            if result is not None:
                x, out = result
                return x, (out if self.tp is None else self.tp.all_reduce(out))
        x, h = add_rms_norm(x, delta, norm_weight, eps)
        return x, self.forward(h, backend, valid_tokens)

    def _out_dtype(self, x: torch.Tensor, backend) -> torch.dtype | None:
        if self.tp is None:
            return model_output_dtype(backend)
        return self.tp.reduce_dtype(x.shape[0], x.dtype)

    def set_decisive_routing(self, on: bool, seed: int = 0) -> None:
        """Give `top_k` experts of this layer's router a bias of 16 (on), or the checkpoint's
        bias back (off): every token then takes the same experts, whatever rounding. For comparing
        two implementations whose sums round differently (`random_tensor_source` explains why);
        the experts come from `seed` alone, so every rank and every engine picks the same. The
        bias is changed in place where the backend reads it, so captured graphs see it too."""
        biases = {
            id(t): t
            for t in (self.weights.router_bias, getattr(self.prepared, "router_bias", None))
            if isinstance(t, torch.Tensor)
        }
        if not hasattr(self, "_bias_backup"):
            self._bias_backup = {key: t.clone() for key, t in biases.items()}
        for key, t in biases.items():
            t.copy_(self._bias_backup[key])
            if on:
                g = torch.Generator().manual_seed(seed)
                chosen = torch.randperm(t.numel(), generator=g)[: self.top_k].to(t.device)
                t[chosen] = 16.0


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp=None):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.mlp_norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.attn = Attention(config, layer, tp)
        self.mlp = MoE(config, tp)

    def forward(self, x, h, meta, kv_cache, cos_sin, backends, next_norm, add_rms_norm, valid_tokens=None):
        """x: [T, H] residual stream; h: rmsnorm(x) with this block's attn_norm, computed by the
        previous block's fused add + norm. Returns (x after the block, x normed by `next_norm`)."""
        attention_backend, moe_backend = backends
        attn_out = self.attn(h, meta, kv_cache, cos_sin, attention_backend)
        x, moe_out = self.mlp.add_norm_forward(
            x, attn_out, self.mlp_norm, self.eps, moe_backend, add_rms_norm, valid_tokens
        )
        return add_rms_norm(x, moe_out, next_norm, self.eps)


class GptOssModel(nn.Module):
    """The whole model. Build with `from_pretrained`; call `forward` then `compute_logits`.

    With `tp` (an `inference.distributed.group.TensorParallelGroup`) it is this rank's shard: `local_config`
    gives the shapes it holds (heads, KV heads, expert columns); `config` stays the whole model's.
    """

    def __init__(self, config: ModelConfig, attention_backend, moe_backend, max_positions: int | None = None, tp=None):
        super().__init__()
        self.config = config
        self.tp = tp
        self.local_config = config
        vocab_rows = config.vocab_size
        if tp is not None:
            self.local_config = local_config(config, tp.layout)
            vocab_rows = tp.layout.vocab_per_rank
        self.attention_backend = attention_backend
        self.moe_backend = moe_backend
        self.add_rms_norm = select_add_rms_norm(torch.device("cpu"))  # from_* pick the device's
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(self.local_config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        self.max_positions = max_positions or config.max_position_embeddings
        self.register_buffer(
            "cos_sin", cos_sin_table(config.rope, config.head_dim, self.max_positions), persistent=False
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list,
        aux_layers: tuple[int, ...] = (),
        valid_tokens: torch.Tensor | None = None,
    ):
        """input_ids: [T] int64 new tokens; kv_caches[layer] = (k_cache, v_cache). Returns hidden [T, H].

        valid_tokens: None, or int32 [1] on the device: a CUDA graph's step padded to its captured
        size has only that many real tokens, first. The padded rows' outputs are garbage that
        nobody reads; the MoE may skip them (see `inference.ops.moe.backend`).

        With `aux_layers` (an EAGLE-3 drafter's input) returns (hidden, aux [T, len(aux_layers) * H]):
        the residual stream after each listed layer, concatenated in the order given.
        """
        aux = {}
        # x += attn(rmsnorm(x)); x += moe(rmsnorm(x)) per layer, each add fused with the norm after it.
        eps = self.config.rms_norm_eps
        add_rms_norm = self.add_rms_norm
        x, h = add_rms_norm(self.embed(input_ids), None, self.layers[0].attn_norm, eps)
        backends = (self.attention_backend, self.moe_backend)
        last = len(self.layers) - 1
        for layer, block in enumerate(self.layers):
            next_norm = self.norm if layer == last else self.layers[layer + 1].attn_norm
            x, h = block(x, h, meta, kv_caches[layer], self.cos_sin, backends, next_norm, add_rms_norm, valid_tokens)
            if layer in aux_layers:
                aux[layer] = x
        if aux_layers:
            return h, torch.cat([aux[layer] for layer in aux_layers], dim=-1)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, H] (already normed) -> logits [N, vocab] float32, written into `out` if given."""
        return self.gather_logits(self.logits_shard(hidden), out)

    def logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> this rank's logits [N, vocab_per_rank] in the model's dtype (all of
        them on one device); padding columns past the vocabulary are zeros."""
        return self.lm_head(hidden)

    def gather_logits(self, shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's `logits_shard` side by side (a collective under tensor parallelism):
        [N, vocab] float32, written into `out` if given."""
        logits = shard if self.tp is None else self.tp.gather_vocab(shard)
        return logits.float() if out is None else out.copy_(logits)

    def set_decisive_routing(self, on: bool, seed: int = 0) -> None:
        """`MoE.set_decisive_routing` in every layer (each its own experts)."""
        for i, block in enumerate(self.layers):
            block.mlp.set_decisive_routing(on, seed * 1000 + i)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        attention_backend: str | None = None,
        moe_backend: str | None = None,
        max_positions: int | None = None,
        progress: bool = True,
        tensor_parallel=None,
    ) -> "GptOssModel":
        """Load a HF-layout gpt-oss checkpoint directory.

        device defaults to CUDA when available; dtype to bfloat16 on GPU and float32 on CPU
        (CPU bf16 matmuls are slow and the reference tests compare in float32).
        tensor_parallel: a `TensorParallelGroup`; the model is then its rank's shard, and only
        that shard's bytes are read from the files.
        """
        config = ModelConfig.from_file(model_dir)
        reader = CheckpointReader(model_dir, config)
        get = reader.get
        if tensor_parallel is not None:
            get = tensor_parallel.tensor_source(config, reader.get_slice, reader.get, tensor_shapes(config))
        model = cls._assemble(
            config,
            get,
            device,
            dtype,
            attention_backend,
            moe_backend,
            max_positions,
            tensor_parallel,
            progress=progress and reader.total_bytes() >= (256 << 20),
        )
        if tensor_parallel is not None:
            tensor_parallel.bytes_read = get.bytes_read
        return model

    @classmethod
    def from_random(
        cls,
        config: ModelConfig,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        attention_backend: str | None = None,
        moe_backend: str | None = None,
        max_positions: int | None = None,
        seed: int = 0,
        tensor_parallel=None,
        decisive_routing: bool = False,
    ) -> "GptOssModel":
        """A model of `config`'s real shapes with random weights made directly on the device.

        For benchmarks: full-size gpt-oss with MXFP4 experts and no checkpoint to download.
        `decisive_routing`: see `random_tensor_source` (for comparing two implementations).
        With `tensor_parallel`, each rank makes every whole tensor (the same for one seed) and
        keeps its shard, so the ranks together hold the model a single device would.
        """
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        get = random_tensor_source(config, device, seed, decisive_routing)
        if tensor_parallel is not None:
            get = tensor_parallel.tensor_source(config, slice_of(get), get, tensor_shapes(config))
        return cls._assemble(
            config, get, device, dtype, attention_backend, moe_backend, max_positions, tensor_parallel, progress=False
        )

    @classmethod
    def _assemble(
        cls,
        config: ModelConfig,
        get,
        device,
        dtype,
        attention_backend,
        moe_backend,
        max_positions,
        tensor_parallel,
        progress: bool,
    ) -> "GptOssModel":
        """The model of `config` on `device` with the weights `get(name)` returns (the arguments
        as `from_pretrained` takes them): built on the meta device, backends chosen, weights
        loaded and converted once for the kernels."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        with torch.device("meta"):
            model = cls(config, None, None, max_positions=max_positions, tp=tensor_parallel)
        model.attention_backend = select_attention_backend(device, attention_backend)
        model.moe_backend = select_moe_backend(device, moe_backend)
        model.add_rms_norm = select_add_rms_norm(device)
        model.cos_sin = cos_sin_table(config.rope, config.head_dim, model.max_positions, device)
        load_weights(model, get, device, dtype, progress=progress)
        use_decode_gemv(model)
        return model.eval()


def random_tensor_source(config: ModelConfig, device, seed: int = 0, decisive_routing: bool = False):
    """A `get(name)` over random tensors with the checkpoint's shapes, made on `device`.

    Float tensors ~ N(0, 1/fan_in) (norm weights 1, sinks N(0,1)); MXFP4 blocks are uniform random
    bytes with scales around 2^-6, which keeps activations finite through many layers.
    Each tensor has its own seed (from `seed` and its name), so it does not depend on which
    tensors were asked for before it (tensor-parallel ranks skip some).

    Random routers leave several experts' scores within rounding of each other, so two correct
    implementations that round differently (bf16 vs float32, another reduction order, TP) send
    tokens to different experts and their outputs part for good. `decisive_routing` sets each
    router's bias to exactly 16 on `experts_per_tok` experts, so the top-k set is stable and such
    comparisons measure the kernels, not the coin flips.
    """
    import zlib

    specs = expected_tensors(config)

    def get(name: str) -> torch.Tensor:
        spec = specs[name]
        # A 32-bit seed: the CPU generator ignores higher bits (seed * 2^32 + ... once made every
        # seed the same weights on CPU). crc32 from `seed` keeps seed 0's weights as they were.
        g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode(), seed & 0xFFFF_FFFF))
        if not spec.float:
            if name.endswith("_scales"):
                return torch.randint(118, 122, spec.shape, generator=g, device=device, dtype=torch.uint8)
            return torch.randint(0, 256, spec.shape, generator=g, device=device, dtype=torch.uint8)
        if name.endswith("norm.weight") or "layernorm" in name:
            return torch.ones(spec.shape, device=device)
        std = 1.0 if name.endswith("sinks") or "embed_tokens" in name else spec.shape[-1] ** -0.5
        if name.endswith("bias"):
            std = 0.02
        tensor = torch.randn(spec.shape, generator=g, device=device, dtype=torch.bfloat16) * std
        if decisive_routing and name.endswith("mlp.router.bias"):
            chosen = torch.randperm(tensor.numel(), generator=g, device=device)[: config.num_experts_per_tok]
            tensor[chosen] = 16.0
        return tensor

    return get


def load_weights(model: GptOssModel, get_tensor, device, dtype, progress: bool = True) -> None:
    """Copy tensors (`get_tensor(name)`, e.g. `CheckpointReader.get`) into the model on `device`,
    layer by layer, with a progress bar when `progress`."""
    from tqdm import tqdm

    c = model.config

    def param(name: str, want_dtype=dtype) -> nn.Parameter:
        return nn.Parameter(get_tensor(name).to(device=device, dtype=want_dtype), requires_grad=False)

    def raw(name: str) -> torch.Tensor:
        return get_tensor(name).to(device)

    model.embed.weight = param("model.embed_tokens.weight")
    model.norm = param("model.norm.weight")
    model.lm_head.weight = param("lm_head.weight")
    bar = tqdm(total=c.num_hidden_layers, desc="loading layers", unit="layer", disable=not progress)
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        block.attn_norm = param(p + "input_layernorm.weight")
        block.mlp_norm = param(p + "post_attention_layernorm.weight")
        a = block.attn
        qkv_w = torch.cat([get_tensor(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        qkv_b = torch.cat([get_tensor(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        a.qkv.weight = nn.Parameter(qkv_w.to(device=device, dtype=dtype), requires_grad=False)
        a.qkv.bias = nn.Parameter(qkv_b.to(device=device, dtype=dtype), requires_grad=False)
        a.o_proj.weight = param(p + "self_attn.o_proj.weight")
        a.o_proj.bias = param(p + "self_attn.o_proj.bias")
        a.sinks = param(p + "self_attn.sinks", torch.float32)
        e = p + "mlp.experts."
        biases = dict(gate_up_bias=raw(e + "gate_up_proj_bias").float(), down_bias=raw(e + "down_proj_bias").float())
        if c.quantized_experts:
            experts = ExpertWeights(
                gate_up_blocks=raw(e + "gate_up_proj_blocks"),
                gate_up_scales=raw(e + "gate_up_proj_scales"),
                down_blocks=raw(e + "down_proj_blocks"),
                down_scales=raw(e + "down_proj_scales"),
                **biases,
            )
        else:
            experts = ExpertWeights(
                gate_up=raw(e + "gate_up_proj").to(dtype), down=raw(e + "down_proj").to(dtype), **biases
            )
        block.mlp.weights = MoEWeights(
            router_weight=raw(p + "mlp.router.weight").to(dtype),
            router_bias=raw(p + "mlp.router.bias").to(dtype),
            experts=experts,
            expert_offset=model.tp.layout.experts[0] if model.tp is not None else 0,
        )
        block.mlp.prepared = model.moe_backend.prepare(block.mlp.weights)
        bar.update(1)
    bar.close()


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's full shape for `config` (what a rank's shard is cut from)."""
    return {name: tuple(spec.shape) for name, spec in expected_tensors(config).items()}
