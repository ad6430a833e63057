"""The tensor-parallel process group as the model sees it: this rank, its shard, its collectives.

Tensors only move through torch.distributed (NCCL on GPU, gloo on CPU) and, for small messages on
GPU, peer memory (`inference/distributed/peer_memory.py`). A layer runs two all-reduces: after
attention's o_proj and after the MoE, each rank holding a partial sum [T, H]. The model sums
them in float32 for steps of up to FLOAT32_REDUCE_MAX_TOKENS tokens (`reduce_dtype`), every
decode step included, and the sum goes straight into the fused residual add + RMSNorm (or the
MoE router's, which does the same), so a reduction adds one kernel to a layer, no cast and no
separate add.

Two all-reduces a layer is the least this block allows. It is pre-norm: the MoE reads
rmsnorm(x + attn(x)) and routes on it, so it needs the whole attention sum before it starts, and
attention's and the MoE's partials cannot be summed together. Sequence-parallel norms (a
reduce-scatter, the norm on T/N rows, an all-gather) move the same bytes in two collectives
instead of one: at decode, where T is 1-256 rows and a collective costs its latency, that is
slower. The logits' all-gather is gone from greedy steps (`combine_argmax`).

How to all-reduce (`ALL_REDUCE_MODES`, the engine's `tp_all_reduce`):
    auto      peer memory for messages that fit its buffer, NCCL for larger ones; NCCL for all
              where peer memory is unavailable (logged once, with the reason)
    symm_mem  the same, but an error where peer memory is unavailable
    nccl      torch.distributed only (NCCL on GPU, gloo on CPU)
    none      nothing: each rank keeps its own partial sums. Wrong output; for measuring what
              a step costs without its collectives (`benchmarks/bench_tensor_parallel.py`).
`inference/engine/executor.py` makes the group.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from inference.config import TP_ALL_REDUCE_MODES as ALL_REDUCE_MODES
from inference.config import ModelConfig
from inference.distributed.sharding import ShardedTensorSource, ShardLayout, shard_layout

log = logging.getLogger(__name__)

# Per collective; idle time never counts (workers wait on their pipe, not in a collective).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# Steps of up to this many tokens (every decode step) reduce float32 partial sums: the sum is then
# rounded once, as on one device, not once per rank. Longer prefill chunks send bf16, half the
# bytes, where the transfer, not the latency, is the cost.
FLOAT32_REDUCE_MAX_TOKENS = 2048


class TensorParallelGroup:
    """This process's rank in the group, its shard layout, and the collectives the model runs.

    `group` is None only for loading a shard without running it (tests, offline checks).
    """

    def __init__(self, layout: ShardLayout, device: torch.device, group=None):
        self.layout = layout
        self.rank, self.size = layout.rank, layout.size
        self.device = torch.device(device)
        self.group = group
        self.bytes_read = 0  # checkpoint bytes this rank read while loading
        self.peer = None  # a `PeerAllReduce` where peer memory works (`join_group`)
        self.peer_unavailable: str | None = None  # why not, where it was asked for
        self.mode = "nccl"  # how `all_reduce` runs now: "peer", "nccl" or "none"

    def set_all_reduce(self, mode: str) -> None:
        """One of ALL_REDUCE_MODES. Every rank must set the same, between steps (CUDA graphs
        captured before keep the collectives they captured: capture them again)."""
        if mode not in ALL_REDUCE_MODES:
            raise ValueError(f"tp_all_reduce must be one of {', '.join(ALL_REDUCE_MODES)}, got {mode!r}")
        if mode == "symm_mem" and self.peer is None:
            raise RuntimeError(
                f"tp_all_reduce 'symm_mem': peer memory is unavailable ({self.peer_unavailable or 'not set up'})"
            )
        self.mode = {"auto": "peer" if self.peer is not None else "nccl", "symm_mem": "peer"}.get(mode, mode)

    def reduce_dtype(self, tokens: int, dtype: torch.dtype) -> torch.dtype:
        """The dtype partial sums of a step of `tokens` tokens are all-reduced in."""
        return torch.float32 if tokens <= FLOAT32_REDUCE_MAX_TOKENS else dtype

    def tensor_source(self, config: ModelConfig, get_slice, get, shapes) -> ShardedTensorSource:
        return ShardedTensorSource(config, self.layout, get_slice, get, shapes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x: x itself (summed in place) or a new tensor. Peer memory where
        the message fits its buffer, else NCCL (the choice depends only on the shape, so every
        rank makes the same)."""
        if self.mode == "none":
            return x
        if self.mode == "peer" and self.peer.fits(x):
            return self.peer(x)
        dist.all_reduce(x, group=self.group)
        return x

    def combine_argmax(self, values: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row from every rank's best of its vocabulary shard: values
        [T] float32 (the shard's maximum, NaN read as +inf), local_ids [T] int64 (its first
        index in the shard) -> [T] int64 token ids, the same on every rank. Ties go to the
        lowest rank, whose ids come first: the first index of the row's maximum, as argmax over
        the whole row gives. One all-reduce of T x N x 2 floats (ids below 2^24 are exact)."""
        t = values.shape[0]
        candidates = torch.zeros(t, self.size, 2, dtype=torch.float32, device=values.device)
        candidates[:, self.rank, 0] = values
        candidates[:, self.rank, 1] = (local_ids + self.layout.vocab[0]).float()
        candidates = self.all_reduce(candidates.view(t, 2 * self.size)).view(t, self.size, 2)
        best = candidates[:, :, 0].argmax(dim=1)
        return candidates[:, :, 1].gather(1, best[:, None]).squeeze(1).long()

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary shard of the logits side by side: [T, V/N] -> [T, V]."""
        t, shard = logits.shape
        out = torch.empty(self.size * t, shard, dtype=logits.dtype, device=logits.device)
        _all_gather_single(out, logits.contiguous(), group=self.group)  # rank r's rows at [r*T, (r+1)*T)
        return out.view(self.size, t, shard).permute(1, 0, 2).reshape(t, self.size * shard)[:, : self.layout.vocab_size]

    def min_across_ranks(self, value: int) -> int:
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return int(x.item())

    def leave(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None


# torch 2.13 renamed all_gather_into_tensor; older releases (GPU hosts) only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def join_group(
    config: ModelConfig,
    rank: int,
    size: int,
    device: torch.device,
    store,
    *,
    moe_parallel: str = "tensor",
    all_reduce: str = "auto",
    peer_bytes: int = 0,
    devices: list[torch.device] | None = None,
) -> TensorParallelGroup:
    """Join the group as `rank` of `size` and set up its collectives: NCCL (gloo on CPU), and on
    CUDA with `all_reduce` "auto" or "symm_mem" a peer-memory buffer of `peer_bytes` shared
    with the ranks on `devices` (every rank's device). Collective: every rank calls it."""
    if all_reduce not in ALL_REDUCE_MODES:
        raise ValueError(f"tp_all_reduce must be one of {', '.join(ALL_REDUCE_MODES)}, got {all_reduce!r}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    if device.type == "cuda":  # create the NCCL communicator now: it cannot be created inside a graph capture
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    tp = TensorParallelGroup(shard_layout(config, rank, size, moe_parallel), device, dist.group.WORLD)
    if all_reduce in ("auto", "symm_mem"):
        if device.type == "cuda" and peer_bytes > 0:
            from inference.distributed.peer_memory import PeerAllReduce

            indices = [d.index for d in devices or [] if d.type == "cuda" and d.index is not None]
            tp.peer, tp.peer_unavailable = PeerAllReduce.create(tp.group, device, peer_bytes, indices)
        else:
            tp.peer_unavailable = "not a CUDA device" if device.type != "cuda" else "no buffer asked for"
        if tp.peer is None and rank == 0 and device.type == "cuda":
            log.warning(
                "tensor parallel: small all-reduces go through NCCL: peer memory is unavailable (%s)",
                tp.peer_unavailable,
            )
    tp.set_all_reduce(all_reduce)
    return tp
