"""The Harmony tokenizer, usable with no network.

openai-harmony reads the o200k vocabulary from `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`
and would download it otherwise. We ship the file in the package and point the variable at it
(unless the user already set it), after checking its sha256 so a corrupt file fails loudly.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from pathlib import Path

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
PACKAGED_VOCAB_DIR = Path(__file__).parent / "vocab"

# Harmony special tokens the engine and agent loop care about.
START = 200006  # <|start|>
END = 200007  # <|end|> ends a message
MESSAGE = 200008  # <|message|>
CHANNEL = 200005  # <|channel|>
CONSTRAIN = 200003  # <|constrain|>
RETURN = 200002  # <|return|> ends the assistant's turn with a final answer
CALL = 200012  # <|call|> ends the assistant's turn with a tool call
ASSISTANT_STOP_TOKENS = (RETURN, CALL)


class VocabularyError(RuntimeError):
    pass


def vocab_dir() -> Path:
    """The folder holding o200k_base.tiktoken: $TIKTOKEN_ENCODINGS_BASE if set, else the package's."""
    env = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    return Path(env) if env else PACKAGED_VOCAB_DIR


@functools.lru_cache(maxsize=None)
def _check_vocab(path: Path) -> None:
    if not path.is_file():
        raise VocabularyError(
            f"Harmony vocabulary file not found at {path}; set TIKTOKEN_ENCODINGS_BASE to the folder "
            f"that holds {VOCAB_FILE}"
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != VOCAB_SHA256:
        raise VocabularyError(f"{path} has sha256 {digest}, expected {VOCAB_SHA256}")


@functools.lru_cache(maxsize=1)
def harmony_encoding():
    """The gpt-oss Harmony encoding (openai_harmony.HarmonyEncoding), loaded offline."""
    folder = vocab_dir()
    _check_vocab(folder / VOCAB_FILE)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@functools.lru_cache(maxsize=1)
def ordinary_token_bytes() -> dict[int, bytes]:
    """The exact bytes of every ordinary token, read from the o200k vocabulary file (base64 bytes
    and rank per line). Harmony's special tokens are not in it. Decoding one token at a time
    would lose bytes where a character spans tokens."""
    table: dict[int, bytes] = {}
    with open(vocab_dir() / VOCAB_FILE, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                table[int(rank)] = base64.b64decode(token)
    return table


def encode_text(text: str) -> list[int]:
    """Plain text to token ids (special-token strings are encoded as text). With nothing
    disallowed, openai-harmony skips its scan of the text for special-token strings, which
    cost about 1.5 ms a call even for a short string (CPU, openai-harmony 0.0.8)."""
    return harmony_encoding().encode(text, allowed_special=set(), disallowed_special=())


def decode_tokens(token_ids: list[int]) -> str:
    return harmony_encoding().decode_utf8(token_ids)
