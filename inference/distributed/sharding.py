"""Tensor parallelism, the math of the split: which slice of every weight each of N ranks holds.

What each rank holds (Megatron-style; `ShardLayout` gives the ranges):
    attention   q heads and KV heads split evenly (N must divide both): the fused qkv projection
                takes this rank's rows of q, k and v, sinks its heads, o_proj its input columns;
                o_proj's output is a partial sum, all-reduced; its bias is loaded on rank 0 only.
    MoE         the router is replicated (every rank routes every token the same way); each
                expert's intermediate dimension is split in whole MXFP4 blocks of 32 values, as
                evenly as blocks allow (2880 = 90 blocks: 45 each at N=2, 23/23/22/22 at N=4):
                gate_up rows [2s, 2e) (HF interleaves gate j at row 2j, up j at 2j+1, so a
                contiguous row range holds matching pairs), down_proj blocks [s/32, e/32). The
                output is all-reduced; the down bias is loaded on rank 0 only.
    lm_head     vocabulary rows split (the last shard padded with zero rows); greedy steps take
                each rank's best token and pick among those (`inference/runner/vocab_parallel.py`),
                the others all-gather the logits so rank 0 can sample.
    replicated  embedding, norms, router.
Each rank reads only its slices from the safetensors files (`CheckpointReader.get_slice`).

Expert parallelism (`moe_parallel="expert"`) splits the MoE the other way: rank r holds experts
[r*E/N, (r+1)*E/N) whole (all their columns, and their own biases), N must divide E. Every rank
still routes every token over all E experts (the router is replicated), adds the contributions
of the experts it holds, and the same all-reduce sums them. At large batches each expert's
weights are then read once, by one GPU, in GEMMs as wide as on one device; under tensor
parallelism every GPU reads a slice of every expert a batch touches.

`inference/distributed/group.py` holds the collectives; `inference/engine/executor.py` starts
and owns the worker processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from inference.config import MOE_PARALLEL_MODES, ModelConfig
from inference.ops.mxfp4 import BLOCK_SIZE


class TensorParallelError(ValueError):
    """tensor_parallel_size does not fit the model; the message names the field and the sizes that do."""


# ----------------------------------------------------------------------------- sharding math


@dataclass(frozen=True)
class ShardLayout:
    """The slices rank `rank` of `size` holds; every range is [start, stop).

    heads / kv_heads: attention heads; intermediate: expert intermediate columns (whole MXFP4
    blocks); experts: the experts it holds (all of them under tensor parallelism, E/N whole ones
    under expert parallelism); vocab: lm_head rows it holds, padded with zero rows to
    `vocab_per_rank`.
    """

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int
    vocab_size: int
    experts: tuple[int, int] = (0, 0)
    moe_parallel: str = "tensor"


def _balanced(units: int, size: int, rank: int) -> tuple[int, int]:
    """Rank's range when `units` are split as evenly as possible (earlier ranks take the extra)."""
    per, extra = divmod(units, size)
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)


def intermediate_unit(config: ModelConfig) -> int:
    """Granularity of the expert split: a whole MXFP4 block, or one column for dense experts."""
    return BLOCK_SIZE if config.quantized_experts else 1


def valid_sizes(config: ModelConfig, limit: int = 64, moe_parallel: str = "tensor") -> list[int]:
    """Every tensor_parallel_size up to `limit` this model can be split into."""
    units = config.intermediate_size // intermediate_unit(config)
    return [
        n
        for n in range(1, limit + 1)
        if config.num_attention_heads % n == 0
        and config.num_key_value_heads % n == 0
        and (n <= units if moe_parallel == "tensor" else config.num_local_experts % n == 0)
    ]


def check_tensor_parallel_size(config: ModelConfig, size: int, moe_parallel: str = "tensor") -> None:
    """Raise TensorParallelError unless the model splits into `size` ranks (the MoE by
    `moe_parallel`: "tensor" splits each expert's columns, "expert" the experts)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if moe_parallel not in MOE_PARALLEL_MODES:
        raise TensorParallelError(f"moe_parallel must be one of {', '.join(MOE_PARALLEL_MODES)}, got {moe_parallel!r}")
    works = ", ".join(map(str, valid_sizes(config, moe_parallel=moe_parallel)))
    for field_name in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, field_name)
        if value % size:
            raise TensorParallelError(
                f"tensor_parallel_size {size} does not divide config field '{field_name}' ({value}); "
                f"sizes that work for this model: {works}"
            )
    if moe_parallel == "expert":
        if config.num_local_experts % size:
            raise TensorParallelError(
                f"tensor_parallel_size {size} does not divide config field 'num_local_experts' "
                f"({config.num_local_experts}), which expert parallelism splits; sizes that work for this "
                f"model: {works}"
            )
        return
    unit = intermediate_unit(config)
    units = config.intermediate_size // unit
    if units < size:
        what = f"{units} MXFP4 blocks of {unit} values" if unit > 1 else f"{units} columns"
        raise TensorParallelError(
            f"tensor_parallel_size {size} is more than config field 'intermediate_size' "
            f"({config.intermediate_size}, {what}) can be split into; sizes that work for this model: {works}"
        )


def shard_layout(config: ModelConfig, rank: int, size: int, moe_parallel: str = "tensor") -> ShardLayout:
    check_tensor_parallel_size(config, size, moe_parallel)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    heads, kv = config.num_attention_heads // size, config.num_key_value_heads // size
    unit = intermediate_unit(config)
    start, stop = _balanced(config.intermediate_size // unit, size, rank)
    experts = (0, config.num_local_experts)
    if moe_parallel == "expert":  # whole experts: every column of E/N of them
        start, stop = 0, config.intermediate_size // unit
        per = config.num_local_experts // size
        experts = (rank * per, (rank + 1) * per)
    per_rank = -(-config.vocab_size // size)
    vocab_start = min(rank * per_rank, config.vocab_size)
    return ShardLayout(
        rank=rank,
        size=size,
        heads=(rank * heads, (rank + 1) * heads),
        kv_heads=(rank * kv, (rank + 1) * kv),
        intermediate=(start * unit, stop * unit),
        vocab=(vocab_start, min(vocab_start + per_rank, config.vocab_size)),
        vocab_per_rank=per_rank,
        vocab_size=config.vocab_size,
        experts=experts,
        moe_parallel=moe_parallel,
    )


def local_config(config: ModelConfig, layout: ShardLayout) -> ModelConfig:
    """The config of the layers this rank builds: its heads, KV heads and expert columns
    (vocab stays global: the embedding is replicated and the logits are gathered back)."""
    return dataclasses.replace(
        config,
        num_attention_heads=layout.heads[1] - layout.heads[0],
        num_key_value_heads=layout.kv_heads[1] - layout.kv_heads[0],
        intermediate_size=layout.intermediate[1] - layout.intermediate[0],
    )


# Where each checkpoint tensor is cut: name suffix -> (rule, dim). Rules: "heads" / "kv_heads"
# (head_dim rows or columns per head), "heads1" (one entry per head), "gate_up" (rows 2s..2e of
# the interleaved gate/up), "inter" (intermediate columns), "inter_blocks" (MXFP4 blocks of them),
# "vocab", "rank0" (a bias after a reduction: rank 0 holds it, the others zeros). The rest is
# replicated. Under expert parallelism every `mlp.experts.` tensor is cut by `_EXPERT_RULE` instead.
_RULES: dict[str, tuple[str, int]] = {
    "self_attn.q_proj.weight": ("heads", 0),
    "self_attn.q_proj.bias": ("heads", 0),
    "self_attn.k_proj.weight": ("kv_heads", 0),
    "self_attn.k_proj.bias": ("kv_heads", 0),
    "self_attn.v_proj.weight": ("kv_heads", 0),
    "self_attn.v_proj.bias": ("kv_heads", 0),
    "self_attn.o_proj.weight": ("heads", 1),
    "self_attn.o_proj.bias": ("rank0", 0),
    "self_attn.sinks": ("heads1", 0),
    "mlp.experts.gate_up_proj_blocks": ("gate_up", 1),  # [E, 2I, H/32, 16]
    "mlp.experts.gate_up_proj_scales": ("gate_up", 1),  # [E, 2I, H/32]
    "mlp.experts.gate_up_proj_bias": ("gate_up", 1),  # [E, 2I]
    "mlp.experts.gate_up_proj": ("gate_up", 2),  # dense [E, H, 2I]
    "mlp.experts.down_proj_blocks": ("inter_blocks", 2),  # [E, H, I/32, 16]
    "mlp.experts.down_proj_scales": ("inter_blocks", 2),  # [E, H, I/32]
    "mlp.experts.down_proj": ("inter", 1),  # dense [E, I, H]
    "mlp.experts.down_proj_bias": ("rank0", 0),
    "lm_head.weight": ("vocab", 0),
}


# Expert parallelism: every expert tensor ([E, ...], biases included) by whole experts.
_EXPERT_RULE = ("experts", 0)


def shard_rule(name: str, moe_parallel: str = "tensor") -> tuple[str, int] | None:
    """(rule, dim) for a checkpoint tensor name, None when it is replicated."""
    if name == "lm_head.weight":
        return _RULES[name]
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    if moe_parallel == "expert" and suffix.startswith("mlp.experts."):
        return _EXPERT_RULE
    return _RULES.get(suffix)


class ShardedTensorSource:
    """`get(name)` over one rank's slices of a checkpoint (or of any full-tensor source).

    get_slice(name, dim, start, stop): the tensor's [start, stop) range along dim (ideally
    reading only those bytes); get(name): a whole (replicated) tensor. `bytes_read` counts what
    this rank took from the source.
    """

    def __init__(self, config: ModelConfig, layout: ShardLayout, get_slice, get, shapes: dict[str, tuple[int, ...]]):
        self.config, self.layout = config, layout
        self.shapes = shapes  # every tensor's full shape (`inference.model.checkpoint.expected_tensors`)
        self._get_slice, self._get = get_slice, get
        self.bytes_read = 0

    def range_of(self, rule: str) -> tuple[int, int]:
        lay, d = self.layout, self.config.head_dim
        if rule == "heads":
            return lay.heads[0] * d, lay.heads[1] * d
        if rule == "kv_heads":
            return lay.kv_heads[0] * d, lay.kv_heads[1] * d
        if rule == "heads1":
            return lay.heads
        if rule == "gate_up":
            return 2 * lay.intermediate[0], 2 * lay.intermediate[1]
        if rule == "inter":
            return lay.intermediate
        if rule == "inter_blocks":
            return lay.intermediate[0] // BLOCK_SIZE, lay.intermediate[1] // BLOCK_SIZE
        if rule == "vocab":
            return lay.vocab
        if rule == "experts":
            return lay.experts
        raise ValueError(f"unknown shard rule {rule!r}")

    def __call__(self, name: str) -> torch.Tensor:
        rule = shard_rule(name, self.layout.moe_parallel)
        if rule is None:
            return self._count(self._get(name))
        kind, dim = rule
        if kind == "rank0":
            if self.layout.rank == 0:
                return self._count(self._get(name))
            return torch.zeros(self.shapes[name])  # never read: added once, by rank 0
        start, stop = self.range_of(kind)
        part = self._count(self._get_slice(name, dim, start, stop))
        if kind == "vocab" and stop - start < self.layout.vocab_per_rank:
            pad = list(part.shape)
            pad[0] = self.layout.vocab_per_rank - (stop - start)
            part = torch.cat([part, torch.zeros(pad, dtype=part.dtype, device=part.device)])
        return part

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def slice_of(get: Callable[[str], torch.Tensor]):
    """A get_slice for a source that can only make whole tensors (random weights): make, cut, copy."""

    def get_slice(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return get(name).narrow(dim, start, stop - start).clone()

    return get_slice
