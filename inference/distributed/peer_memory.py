"""The all-reduce of a decode step's few kilobytes over peer memory, not NCCL.

A gpt-oss layer all-reduces twice (attention's o_proj and the MoE each leave a partial sum on
every rank): at batch 1 that is 2880 values, 72 times a token for 120b. Such a message is all
latency. With PyTorch's symmetric memory (`torch.distributed._symmetric_memory`) each rank
allocates one buffer that every other rank maps (CUDA IPC over NVLink), and one kernel does the
whole all-reduce:

    one-shot (up to ONE_SHOT_MAX_BYTES)  copy this rank's partial into its buffer, meet the peers
                                         at a barrier of flags, read all N buffers and sum them
    two-shot (up to the buffer's size)   each rank sums 1/N of the elements from every buffer,
                                         then every rank reads the other N-1 sums

Both are PyTorch's kernels (`torch.ops.symm_mem`), launched on the current stream with no host
synchronisation, so CUDA graphs capture them: the buffer is allocated and exchanged once, here,
before any capture, sized for the largest decode graph (`capacity_bytes`). Larger messages
(prefill chunks) stay with NCCL (`TensorParallelGroup.all_reduce` chooses by size).

Every rank adds the N partials in rank order, so all ranks hold the same bits. Sums are float32:
the buffer is float32, and the model hands over float32 partials for steps this small.

NVLink multicast (NVLS) stays off: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (PyTorch then creates no
multicast object) and no `multimem_*` op is used; the backend is PyTorch's own CUDA one
(TORCH_SYMMMEM=CUDA, not NVSHMEM).
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import torch
import torch.distributed as dist

from inference.device import cuda_index

log = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 256 << 10  # 22 rows of 2880 float32 values; larger messages take two-shot
MAX_BYTES = 8 << 20  # the most a buffer holds (256 rows of 2880 float32 values take 2.9 MB)
WORLD_SIZES = (2, 4, 8)  # the sizes PyTorch's two-shot kernel is built for
SELF_TEST_TIMEOUT_S = 20.0


class PeerMemoryHang(RuntimeError):
    """A peer-memory all-reduce never finished: its kernel still waits on the GPU, and nothing
    queued behind it can run, NCCL included. The process cannot go on."""


def disable_multicast_environment() -> None:
    """The variables that keep symmetric memory off NVLink multicast and on the CUDA backend.
    PyTorch reads them once, at first use: set them before any symmetric-memory call."""
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["TORCH_SYMMMEM"] = "CUDA"


class PeerAllReduce:
    """A rendezvoused float32 symmetric buffer of `capacity_bytes` and the all-reduce over it.
    Build with `create` (collective: every rank of `group` calls it)."""

    def __init__(self, group, device: torch.device, capacity_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.rank, self.size = group.rank(), group.size()
        device = torch.device(device)
        self.device = torch.device("cuda", cuda_index(device))
        self.capacity = capacity_bytes // 4 * 4
        self.buffer = symm_mem.empty(self.capacity // 4, dtype=torch.float32, device=self.device)
        self.buffer.zero_()
        torch.cuda.synchronize(self.device)
        try:
            self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        except RuntimeError as e:
            # Older PyTorch wants the group registered first. Newer has it deprecated, and there a
            # registered group costs a store round trip in every op's look-up: only where needed.
            if "group info" not in str(e):
                raise
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group_name)
            self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        ops = torch.ops.symm_mem
        # One launch for copy-in and reduce where this PyTorch has it.
        self._one_shot_copy = ops.one_shot_all_reduce_copy_out if hasattr(ops, "one_shot_all_reduce_copy_out") else None
        self.one_shot_max_bytes = ONE_SHOT_MAX_BYTES

    @classmethod
    def create(cls, group, device: torch.device, capacity_bytes: int, peer_devices: list[int]):
        """(PeerAllReduce, None) where every rank can use it, else (None, why not). Collective:
        the ranks agree (over `group`, NCCL) before and after the buffer exchange, and a first
        all-reduce of known values must come out right on every rank."""
        reason = _local_obstacle(group, device, peer_devices)
        if not _all_agree(reason is None, device, group):
            return None, reason or "another rank cannot use symmetric memory"
        disable_multicast_environment()
        try:
            with torch.cuda.device(device):  # the ops launch on the current device's stream
                peer = cls(group, device, min(capacity_bytes, MAX_BYTES))
                reason = peer.self_test()
        except PeerMemoryHang:
            raise
        except Exception as e:  # (a rank failing here may leave the others waiting on the exchange)
            peer, reason = None, f"symmetric memory failed: {type(e).__name__}: {e}"
        if not _all_agree(reason is None, device, group):
            return None, reason or "the symmetric-memory all-reduce failed on another rank"
        return peer, None

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.device == self.device and x.numel() * 4 <= self.capacity

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (float32, `fits`), in a new tensor."""
        n = x.numel()
        staged = self.buffer[:n].view(x.shape)  # offset 0 of the buffer: what the kernels address
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if n * 4 <= self.one_shot_max_bytes:
            if self._one_shot_copy is not None and x.is_contiguous() and x.storage_offset() == 0:
                self._one_shot_copy(staged, x, "sum", self.group_name, out)
            else:
                staged.copy_(x)
                torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        else:
            staged.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out

    def self_test(self) -> str | None:
        """Both kernels on values whose sum is known; None when right. A kernel still running
        after SELF_TEST_TIMEOUT_S (a peer that never reaches the barrier) is an error: the
        process cannot take it back, so the caller must not go on."""
        want = self.size * (self.size + 1) / 2
        for rows in (1, max(2, (self.one_shot_max_bytes // 4 + 1024) // 1024)):
            if rows * 1024 * 4 > self.capacity:
                continue
            x = torch.full((rows, 1024), float(self.rank + 1), dtype=torch.float32, device=self.device)
            try:
                got = self(x)
            except (RuntimeError, TypeError) as e:  # (checked on the host, so on every rank alike)
                if self._one_shot_copy is None or rows * 4096 > self.one_shot_max_bytes:
                    raise
                log.info("one_shot_all_reduce_copy_out failed (%s); copying in a launch of its own", e)
                self._one_shot_copy = None
                got = self(x)
            done = torch.cuda.Event()
            done.record()
            deadline = time.monotonic() + SELF_TEST_TIMEOUT_S
            while not done.query():
                if time.monotonic() > deadline:
                    raise PeerMemoryHang(
                        f"the symmetric-memory all-reduce of {rows} rows did not finish in "
                        f"{SELF_TEST_TIMEOUT_S:.0f} s (peers unreachable?)"
                    )
                time.sleep(0.001)
            if not torch.all(got == want):
                return f"the symmetric-memory all-reduce of {rows} rows gave wrong sums"
        return None


def _local_obstacle(group, device: torch.device, peer_devices: list[int]) -> str | None:
    """Why this rank cannot use the peer-memory all-reduce, or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return "not a CUDA device"
    if group.size() not in WORLD_SIZES:
        return f"group of {group.size()} ranks (the kernels take {', '.join(map(str, WORLD_SIZES))})"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except ImportError as e:
        return f"this PyTorch has no symmetric memory ({e})"
    ops = torch.ops.symm_mem
    for name in ("one_shot_all_reduce_out", "two_shot_all_reduce_out"):
        if not hasattr(ops, name):
            return f"this PyTorch has no torch.ops.symm_mem.{name}"
    mine = cuda_index(device)
    blocked = [d for d in peer_devices if d != mine and not torch.cuda.can_device_access_peer(mine, d)]
    if blocked:
        return f"cuda:{mine} cannot access the memory of cuda:{', cuda:'.join(map(str, blocked))} (no P2P)"
    return None


def _all_agree(ok: bool, device: torch.device, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
