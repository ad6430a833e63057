"""The model on one sequence with its own small paged cache: the simplest way to run it.

The serving engine (`inference/engine/core.py`) shares one page pool among many sequences; this
module gives a single sequence contiguous pages so tests and `oss-agent generate` can prefill a
prompt and then decode one token per step through exactly the same model code and kernels.
"""

from __future__ import annotations

import torch

from inference.model.gpt_oss import GptOssModel
from inference.ops.attention.reference import AttentionMetadata


class SingleSequenceCache:
    """KV pages for one sequence of up to `max_len` tokens; page i is physical page i. kv_dtype:
    the caches' dtype (None: the model's; `EngineConfig.kv_cache_dtype`)."""

    def __init__(self, model: GptOssModel, max_len: int, page_size: int = 16, kv_dtype: torch.dtype | None = None):
        c = model.local_config  # under tensor parallelism: this rank's KV heads
        self.model = model
        self.page_size = page_size
        self.num_pages = -(-max_len // page_size)
        self.length = 0  # tokens already in the cache
        shape = (self.num_pages, page_size, c.num_key_value_heads, c.head_dim)
        dtype = kv_dtype or model.dtype
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=model.device),
                torch.zeros(shape, dtype=dtype, device=model.device),
            )
            for _ in range(c.num_hidden_layers)
        ]
        self.block_table = torch.arange(self.num_pages, dtype=torch.int32, device=model.device)[None]

    def metadata(self, num_new: int) -> AttentionMetadata:
        start, end = self.length, self.length + num_new
        if end > self.num_pages * self.page_size:
            raise ValueError(f"sequence of {end} tokens exceeds this cache's {self.num_pages * self.page_size}")
        device = self.model.device
        positions = torch.arange(start, end, device=device)
        slots = positions.clone()  # page p holds positions p*page_size.., so slot == position
        return AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, num_new], dtype=torch.int32, device=device),
            context_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables={"full": self.block_table, "sliding": self.block_table},
            slot_mapping={"full": slots, "sliding": slots},
            positions=positions,
            max_q_len=num_new,
            q_lens=[num_new],
            context_lens_list=[end],
        )

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Append tokens and return their logits [len(token_ids), vocab] float32."""
        meta = self.metadata(len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.model.device)
        hidden = self.model(ids, meta, self.kv_caches)
        self.length += len(token_ids)
        return self.model.compute_logits(hidden)


def generate(
    model: GptOssModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    temperature: float = 0.0,
    seed: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> list[int]:
    """Prefill the prompt, then decode one token per step. Greedy when temperature == 0."""
    cache = SingleSequenceCache(model, len(prompt_ids) + max_new_tokens, kv_dtype=kv_dtype)
    generator = torch.Generator(device=model.device)
    if seed is not None:
        generator.manual_seed(seed)
    logits = cache.forward(prompt_ids)[-1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        if temperature == 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(token)
        if token in stop_token_ids:
            break
        logits = cache.forward([token])[-1]
    return out
