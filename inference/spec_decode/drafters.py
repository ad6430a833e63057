"""Which drafter speculative decoding runs: one of `SPECULATIVE_METHODS`, built for a target model."""

from __future__ import annotations

from pathlib import Path

from inference.config import SPECULATIVE_METHODS
from inference.spec_decode.drafter import Drafter
from inference.spec_decode.eagle3 import Eagle3Drafter
from inference.spec_decode.ngram import NgramDrafter


def make_drafter(method: str, draft_model: str | Path | None, target) -> Drafter:
    """The drafter for `method` ("ngram" or "eagle3") serving `target` (a GptOssModel)."""
    if method == "ngram":
        return NgramDrafter()
    if method == "eagle3":
        if draft_model is None:
            raise ValueError("speculative method eagle3 needs a draft model directory (draft_model)")
        return Eagle3Drafter.from_pretrained(draft_model, target)
    raise ValueError(f"unknown speculative method {method!r}; choose from {', '.join(SPECULATIVE_METHODS)}")
