"""flashinfer's paged sink attention behind the attention-backend interface.

flashinfer (0.7.x, optional: the `gpu` extra) has no gpt-oss attention of its own, but its
batch prefill kernels take a custom "AttentionSink" variant (`BatchAttentionWithAttentionSinkWrapper`):
one extra per-head logit in every softmax denominator, which is the sink of docs/design.md §1, and a
left window, which is the sliding layers' mask. Both the FA2 (any CUDA GPU) and FA3 (Hopper)
kernels exist; they are compiled by flashinfer's JIT on first use and cached on disk
(`~/.cache/flashinfer`), so the first start on a machine takes minutes (`warmup` does it up front).

How our cache maps onto flashinfer's paged layout (NHD: [pages, page_size, Hkv, D], the same as
ours, so the caches are passed as they are):
  * each sequence lists the physical pages of its keys in order (`paged_kv_indices`), with the
    number of valid slots in its last page;
  * a sliding layer lists only pages from the one holding its oldest visible key: earlier pages
    may be freed (-1). Dropping whole leading pages shifts every key and query position by the
    same amount, and both the causal mask and the window depend only on differences, so the
    result is unchanged;
  * flashinfer's window keeps key j for query i when i - j <= window_left, ours when
    i - j < window: window_left = window - 1.

flashinfer plans a step on the host (`plan`: work partitioning from the sequence lengths) and
cannot plan inside a CUDA graph. Plans are made once per step and attention kind (full or
sliding) and reused by every layer of that kind.

Which kernel runs where is measured (`benchmarks/bench_attention.py`, docs/benchmark-log.md "Which
backend runs where"): flashinfer where it is faster, the Triton kernels elsewhere. Decode steps
run inside CUDA graphs and stay on Triton, which reaches 91-99% of copy bandwidth there.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from inference.ops.attention.reference import AttentionMetadata

log = logging.getLogger(__name__)

KERNELS = ("fa2", "fa3")
WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace for prefill


def flashinfer_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


def default_kernel(device: torch.device) -> str:
    """FA3 on Hopper (it uses Hopper-only instructions), FA2 elsewhere."""
    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"


@dataclass
class PagedLayout:
    """One step's sequences in flashinfer's CSR page layout (host tensors, B sequences).

    qo_indptr:     [B+1] int32, offsets of each sequence's new tokens (our cu_seqlens_q)
    kv_indptr:     [B+1] int32, offsets of each sequence's pages in the flat page list
    last_page_len: [B] int32, valid slots in each sequence's last listed page (1..page_size)
    table_index:   [N] int64, where each listed page sits in the block table viewed flat
                   (row * table_width + column): the page ids are gathered on the device
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor
    table_index: torch.Tensor


def paged_layout(
    q_lens: list[int], context_lens: list[int], page_size: int, window: int | None, table_width: int
) -> PagedLayout:
    """The pages each sequence's new queries may read: all of them on full layers; on sliding
    layers, from the page holding the oldest key any of its queries sees."""
    q = torch.tensor(q_lens, dtype=torch.int64)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    if bool((ctx < 1).any()):
        raise ValueError("every sequence in a step has at least one key")
    first_key = torch.zeros_like(ctx) if window is None else (ctx - q - window + 1).clamp(min=0)
    first_page = first_key // page_size
    end_page = (ctx + page_size - 1) // page_size
    counts = end_page - first_page
    kv_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=kv_indptr[1:])
    qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=qo_indptr[1:])
    row = torch.repeat_interleave(torch.arange(len(q_lens)), counts)
    column = torch.arange(int(kv_indptr[-1])) - kv_indptr[:-1][row] + first_page[row]
    return PagedLayout(
        qo_indptr=qo_indptr.to(torch.int32),
        kv_indptr=kv_indptr.to(torch.int32),
        last_page_len=(ctx - (end_page - 1) * page_size).to(torch.int32),
        table_index=row * table_width + column,
    )


class FlashInferAttention:
    """Paged sink attention through flashinfer's JIT kernels (`kernel` "fa2" or "fa3").

    `attention` has the contract of `inference.ops.attention.reference.sink_attention_reference` for bf16/fp16
    queries; the caller (`FlashInferAttentionBackend`) sends it only what it should run.
    """

    def __init__(self, device: torch.device, kernel: str | None = None, workspace: torch.Tensor | None = None):
        """workspace: flashinfer's float scratch (uint8, WORKSPACE_BYTES) to share with another
        instance whose steps never overlap this one's; allocated when None."""
        import flashinfer

        self._flashinfer = flashinfer
        self.device = torch.device(device)
        self.kernel = kernel or default_kernel(self.device)
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown flashinfer kernel {self.kernel!r}; choose from {', '.join(KERNELS)}")
        self.workspace = (
            workspace if workspace is not None else torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        )
        self._wrappers: dict[tuple, object] = {}  # (window, dtype, head_dim) -> wrapper
        self._step: AttentionMetadata | None = None  # the step the plans below belong to
        self._planned: set[tuple] = set()

    def _wrapper(self, window: int | None, dtype: torch.dtype, head_dim: int):
        key = (window, dtype, head_dim)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            wrapper = self._flashinfer.BatchAttentionWithAttentionSinkWrapper(
                self.workspace,
                kv_layout="NHD",
                backend=self.kernel,
                q_data_type=dtype,
                kv_data_type=dtype,
                head_dim_qk=head_dim,
                head_dim_vo=head_dim,
                window_left=-1 if window is None else window - 1,
            )
            self._wrappers[key] = wrapper
        return wrapper

    def plan(
        self,
        meta: AttentionMetadata,
        block_table: torch.Tensor,
        window: int | None,
        dtype: torch.dtype,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
    ):
        """Plan `meta`'s step for one attention kind (host work plus one small copy); layers of
        the same kind in the same step reuse it."""
        if meta is not self._step:
            self._step, self._planned = meta, set()
        key = (window, dtype, head_dim)
        wrapper = self._wrapper(window, dtype, head_dim)
        if key in self._planned:
            return wrapper
        layout = paged_layout(meta.q_lens, meta.context_lens_list, page_size, window, block_table.shape[1])
        index = layout.table_index.pin_memory().to(self.device, non_blocking=True)
        pages = block_table.reshape(-1)[index]
        wrapper.plan(
            layout.qo_indptr,
            layout.kv_indptr,
            pages,
            layout.last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            causal=True,
            window_left=-1 if window is None else window - 1,
            q_data_type=dtype,
            kv_data_type=dtype,
            non_blocking=True,
        )
        self._planned.add(key)
        return wrapper

    def attention(self, q, k_cache, v_cache, meta, block_table, sinks, sm_scale, window):
        """q: [T, Hq, D] bf16/fp16; caches [pages, page_size, Hkv, D]; sinks [Hq] -> [T, Hq, D]."""
        _, hq, d = q.shape
        wrapper = self.plan(meta, block_table, window, q.dtype, hq, k_cache.shape[2], d, k_cache.shape[1])
        return wrapper.run(q.contiguous(), (k_cache, v_cache), sinks.float(), float(sm_scale))

    def warmup(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        windows: tuple[int | None, ...],
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """Compile (or load from flashinfer's cache) the kernels a model will use, before serving:
        one tiny step per attention kind."""
        pages = 2
        k_cache = torch.zeros(pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=self.device)
        v_cache = torch.zeros_like(k_cache)
        table = torch.arange(pages, dtype=torch.int32, device=self.device)[None]
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([page_size + 1], dtype=torch.int32, device=self.device),
            block_tables={},
            slot_mapping={},
            positions=torch.tensor([page_size - 1, page_size], device=self.device),
            max_q_len=2,
            q_lens=[2],
            context_lens_list=[page_size + 1],
        )
        q = torch.zeros(2, num_qo_heads, head_dim, dtype=dtype, device=self.device)
        sinks = torch.zeros(num_qo_heads, device=self.device)
        log.info(
            "flashinfer: preparing %s kernels for windows %s (the first start on a machine compiles them, "
            "which takes minutes)",
            self.kernel,
            list(windows),
        )
        for window in windows:
            self.attention(q, k_cache, v_cache, meta, table, sinks, 1.0, window)
        torch.cuda.synchronize(self.device)
        log.info("flashinfer: %s kernels ready", self.kernel)
