"""A step's integer inputs packed into one buffer: one host write, one copy to the device.

`model_runner.build_metadata` is the plain definition of the step metadata (a handful of torch
ops and one copy per tensor). `StepInputPacker.pack` produces the same tensors, but computes them
with numpy straight into a reusable host buffer (pinned on CUDA, `transfers.StagingBuffers`) and
sends that buffer with a single non-blocking copy; the device tensors are views into the copy.

Buffer layout (B sequences, T new tokens, S sample rows, W pages in the widest page table), each
array starting on a 16-byte boundary (as a tensor of its own would; kernels may load vectors):
    int64: input_ids [T], positions [T], full slots [T], sliding slots [T], sample_rows [S]
    int32: cu_seqlens_q [B+1], context_lens [B], full block table [B, W], sliding block table [B, W]
Without sliding layers the sliding slots and table are left out and the "sliding" entries of
the metadata are the full ones (never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.ops.attention.reference import AttentionMetadata
from inference.transfers import StagingBuffers


def table_width(pages: int, q_lens: list[int]) -> int:
    """A step's block-table width for its longest sequence's `pages` (-1 past each row's own).
    Steps where prompts join (some sequence has other than one new token) round it up to whole
    16s: their leading decode rows run the decode kernel, which specialises on the table's row
    stride (divisible by 16 or not), and a width that followed the step would compile variants
    while serving. Pure decode steps keep theirs (their graphs' tables are max_pages wide)."""
    return pages if max(q_lens) == 1 else -(-pages // 16) * 16


def _with_padding(sizes: list[int], multiple: int) -> list[int]:
    """[n0, pad0, n1, pad1, ...]: each array's length, then filler up to a multiple of `multiple`
    (so that the next array starts on a 16-byte boundary)."""
    return [x for n in sizes for x in (n, -n % multiple)]


def _split(array: np.ndarray, chunks: list[int]) -> list[np.ndarray]:
    """The arrays of `_with_padding` chunks (fillers dropped), as views of `array`."""
    out, at = [], 0
    for i in range(0, len(chunks), 2):
        out.append(array[at : at + chunks[i]])
        at += chunks[i] + chunks[i + 1]
    return out


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64


class StepInputPacker:
    """Packs each step's inputs into `StagingBuffers` and sends them to `device` in one copy."""

    def __init__(self, page_size: int, device: torch.device):
        self.page_size = page_size
        self.device = device
        self.staging = StagingBuffers(device)

    def pack(
        self,
        input_ids: list[int],
        full_tables: list[list[int]],
        sliding_tables: list[list[int]] | None,
        starts: list[int],
        q_lens: list[int],
        sample_rows: list[int],
    ) -> StepInputs:
        """The inputs of sequences whose new tokens sit at positions [starts[b], starts[b] + q_lens[b])
        (arguments as in `build_metadata`; `input_ids` [T], `sample_rows` [S])."""
        ps = self.page_size
        b, t = len(q_lens), len(input_ids)
        w = table_width(max(len(table) for table in full_tables), q_lens)
        kinds = 2 if sliding_tables is not None else 1
        # int64: ids, positions, slots per kind, sample rows; int32: cu_seqlens, context lens, tables
        chunks64 = _with_padding([t, t, *[t] * kinds, len(sample_rows)], 2)
        chunks32 = _with_padding([b + 1, b, *[b * w] * kinds], 4)
        bytes64 = 8 * sum(chunks64)
        nbytes = bytes64 + 4 * sum(chunks32)
        host = self.staging.take(nbytes)
        ids, pos, *slots, rows = _split(host[:bytes64].view(np.int64), chunks64)
        cu, context, *tables = _split(host[bytes64:].view(np.int32), chunks32)
        tables = [table.reshape(b, w) for table in tables]

        ids[:] = input_ids
        rows[:] = sample_rows
        start = np.asarray(starts, dtype=np.int64)
        if t == b:  # one token per sequence (decode): token i is sequence i's
            seq_index = np.arange(b)
            cu[:] = np.arange(b + 1)
            pos[:] = start
            context[:] = start + 1
        else:  # flat token i belongs to sequence seq_index[i] and sits at its start + offset
            q = np.asarray(q_lens, dtype=np.int64)
            ends = np.cumsum(q)
            cu[0], cu[1:] = 0, ends
            seq_index = np.repeat(np.arange(b), q)
            pos[:] = np.arange(t) + (start - (ends - q))[seq_index]
            context[:] = start + q
        page, within = pos // ps, pos % ps
        for table_out, slots_out, kind_tables in zip(tables, slots, (full_tables, sliding_tables)):
            table_out.fill(-1)
            for row, table in zip(table_out, kind_tables):
                row[: len(table)] = table
            slots_out[:] = table_out[seq_index, page].astype(np.int64) * ps + within

        # The same views on the device: one copy, then two typed views split into the arrays.
        dev = self.staging.send(nbytes)
        ids, pos, *slots, rows = dev[:bytes64].view(torch.int64).split_with_sizes(chunks64)[::2]
        cu, context, *tables = dev[bytes64:].view(torch.int32).split_with_sizes(chunks32)[::2]
        tables = [table.view(b, w) for table in tables]
        meta = AttentionMetadata(
            cu_seqlens_q=cu,
            context_lens=context,
            block_tables={"full": tables[0], "sliding": tables[-1]},
            slot_mapping={"full": slots[0], "sliding": slots[-1]},
            positions=pos,
            max_q_len=max(q_lens),
            q_lens=list(q_lens),
            context_lens_list=[a + n for a, n in zip(starts, q_lens)],
        )
        return StepInputs(ids, meta, rows)
