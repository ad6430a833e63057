"""The exact bytes of each token, for logprobs (`token`, `bytes`).

Ordinary tokens are their bytes in the o200k vocabulary (`inference/tokenizer.py`); Harmony's
special tokens, which are not in it, are their names.
"""

from __future__ import annotations

from inference.tokenizer import harmony_encoding
from inference.tokenizer import ordinary_token_bytes as _vocabulary


def token_bytes(token_id: int) -> bytes:
    found = _vocabulary().get(token_id)
    if found is not None:
        return found
    return harmony_encoding().decode([token_id]).encode()


def is_special(token_id: int) -> bool:
    """A Harmony special token (`<|start|>`, `<|channel|>`, ...): markup, not text."""
    return token_id not in _vocabulary()


def logprob_entry(token_id: int, logprob: float, top: list[tuple[int, float]], limit: int) -> dict:
    """A token's logprob as OpenAI writes it (`token`, `bytes`, `logprob`, `top_logprobs`)."""

    def entry(token: int, value: float) -> dict:
        raw = token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "logprob": value}

    return {**entry(token_id, logprob), "top_logprobs": [entry(t, v) for t, v in top[:limit]]}


def token_text(token_id: int) -> str:
    return token_bytes(token_id).decode("utf-8", errors="replace")
