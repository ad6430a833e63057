"""The tensor-parallel process group as the model sees it: this rank, its shard, its collectives.

Tensors only move through torch.distributed (NCCL on GPU, gloo on CPU). The model calls
`all_reduce` after attention's o_proj and after the MoE (each rank holds a partial sum) and
`gather_vocab` after the lm_head; `inference/engine/executor.py` makes the group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from inference.config import ModelConfig
from inference.distributed.sharding import ShardedTensorSource, ShardLayout, shard_layout

# Per collective; idle time never counts (workers wait on their pipe, not in a collective).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


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

    def tensor_source(self, config: ModelConfig, get_slice, get, shapes) -> ShardedTensorSource:
        return ShardedTensorSource(config, self.layout, get_slice, get, shapes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x (in place)."""
        dist.all_reduce(x, group=self.group)
        return x

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


def join_group(config: ModelConfig, rank: int, size: int, device: torch.device, store) -> TensorParallelGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    if device.type == "cuda":  # create the NCCL communicator now: it cannot be created inside a graph capture
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    return TensorParallelGroup(shard_layout(config, rank, size), device, dist.group.WORLD)
