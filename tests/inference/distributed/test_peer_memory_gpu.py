"""The peer-memory all-reduce (PyTorch symmetric memory) on 2 and 4 GPUs, against NCCL's.

One process a GPU (spawned), NCCL beside it, NVLink multicast off. For the messages a decode
step sends (1 to 256 rows of 2880 float32 values: one-shot up to 256 KiB, two-shot above):
  * the sum equals NCCL's float32 sum to float32 rounding (the order differs), and NCCL's bf16
    sum (what tensor parallelism sent before) to bf16 rounding;
  * every rank holds the same bits (the partials are added in rank order everywhere);
  * captured in a CUDA graph and replayed on new values, the same;
  * the vocabulary-parallel argmax's combine over it picks the lowest rank on a tie.
Skips without the GPUs; a machine whose GPUs cannot reach each other's memory fails with why.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch

ROWS = (1, 8, 64, 256)
HIDDEN = 2880


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, queue) -> None:
    try:
        queue.put((rank, _check(rank, size, port)))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def _check(rank: int, size: int, port: int) -> str | None:
    """None when every check passes on this rank, else what failed."""
    import torch.distributed as dist

    from inference.config import ModelConfig
    from inference.distributed.group import TensorParallelGroup
    from inference.distributed.peer_memory import PeerAllReduce, disable_multicast_environment
    from inference.distributed.sharding import shard_layout

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    disable_multicast_environment()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size)
    try:
        dist.all_reduce(torch.zeros(1, device=device))
        peer, why = PeerAllReduce.create(dist.group.WORLD, device, max(ROWS) * HIDDEN * 4, list(range(size)))
        if peer is None:
            return f"peer memory unavailable: {why}"
        g = torch.Generator(device=device).manual_seed(100 + rank)
        problems = []
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, generator=g, device=device)
            got = peer(x)
            want = x.clone()
            dist.all_reduce(want)
            bf16 = x.bfloat16()
            dist.all_reduce(bf16)
            scale = want.abs().max().item()
            if (got - want).abs().max().item() > 1e-6 * scale * size:
                problems.append(f"{rows} rows: differs from NCCL's float32 sum")
            if (got - bf16.float()).abs().max().item() > size * 2**-7 * scale:
                problems.append(f"{rows} rows: differs from NCCL's bf16 sum by more than bf16 rounding")
            copies = [torch.empty_like(got) for _ in range(size)]
            dist.all_gather(copies, got)
            if not all(torch.equal(c, copies[0]) for c in copies):
                problems.append(f"{rows} rows: ranks hold different bits")
        # Inside a CUDA graph: every size captured in one graph, replayed on new inputs.
        inputs = [torch.zeros(rows, HIDDEN, device=device) for rows in ROWS]
        for _ in range(2):  # warm-up, as `record_graph` does
            [peer(x) for x in inputs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = [peer(x) for x in inputs]
        for trial in range(3):
            for x in inputs:
                x.copy_(torch.randn(x.shape, generator=g, device=device))
            graph.replay()
            for rows, x, out in zip(ROWS, inputs, outputs):
                want = x.clone()
                dist.all_reduce(want)
                if (out - want).abs().max().item() > 1e-6 * want.abs().max().item() * size:
                    problems.append(f"graph replay {trial}, {rows} rows: differs from NCCL")
        # The greedy combine over peer memory: a tie across ranks goes to the lowest rank.
        config = ModelConfig(num_attention_heads=64, num_key_value_heads=8)
        tp = TensorParallelGroup(shard_layout(config, rank, size), device, dist.group.WORLD)
        tp.peer, tp.mode = peer, "peer"
        values = torch.tensor([1.0, float(rank), 5.0], device=device)  # row 0 tied everywhere
        local = torch.tensor([3, 0, 7], device=device)
        ids = tp.combine_argmax(values, local).tolist()
        per_rank = tp.layout.vocab_per_rank
        if ids != [3, (size - 1) * per_rank, 7]:
            problems.append(f"combine_argmax gave {ids}")
        torch.cuda.synchronize()
        return "; ".join(problems) or None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "size", [pytest.param(2, marks=pytest.mark.gpu(count=2)), pytest.param(4, marks=pytest.mark.gpu(count=4))]
)
def test_peer_all_reduce_matches_nccl_in_and_out_of_cuda_graphs(size):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, size, port, queue)) for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=300) for _ in procs)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    failures = {rank: result for rank, result in results.items() if result is not None}
    assert not failures, failures
