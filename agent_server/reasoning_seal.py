"""Reasoning sealed for clients that keep the conversation themselves (`store: false`).

With `include: ["reasoning.encrypted_content"]` each reasoning item carries its Harmony
analysis sealed with AES-256-GCM (the `cryptography` package) under a key only the server
holds. A client sending the item back in a later request gets the model to see its own
analysis again, exactly as it would through `previous_response_id`; the authentication tag
makes sure that what the model reads as its own reasoning is what it wrote. A blob that was
altered, or sealed under another key, fails to open and the request gets a 400.

The key is 32 random bytes in a file: `--reasoning-key-file`, or `reasoning.key` beside the
response store, created on first use with mode 0600. Servers that share the file open each
other's blobs.

Compaction items (`POST /v1/responses/compact`) carry the model's summary of a conversation
sealed the same way, under the same key.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

VERSION = b"\x01"  # the blob's first byte: its layout (version, 12-byte nonce, ciphertext and tag)
ASSOCIATED = b"oss-agent reasoning"  # binds the blob to this use of the key
SUMMARY_ASSOCIATED = b"oss-agent compaction"  # ... and a compaction's to that one
NONCE_BYTES = 12
KEY_BYTES = 32


class SealError(ValueError):
    """A blob that is not one this server sealed (altered, foreign, or not a blob at all)."""


class ReasoningSeal:
    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a reasoning key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)

    @classmethod
    def from_file(cls, path: Path) -> "ReasoningSeal":
        """The key in `path`, created there (0600) if the file does not exist yet."""
        path = Path(path).expanduser()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:  # O_EXCL: of two servers starting at once, one writes the key and both use it
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(KEY_BYTES))
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise ValueError(f"{path} holds {len(key)} bytes; a reasoning key file holds {KEY_BYTES} random bytes")
        return cls(key)

    def seal(self, analysis: str) -> str:
        """The analysis text as an opaque, authenticated blob (URL-safe base64)."""
        return self._seal("analysis", analysis, ASSOCIATED)

    def open(self, blob: str) -> str:
        """The analysis text a blob of `seal` holds; SealError for anything else."""
        return self._open("analysis", blob, ASSOCIATED, "an encrypted reasoning blob")

    def seal_summary(self, summary: str) -> str:
        """A compaction's summary of a conversation, sealed as `seal` seals reasoning (under its
        own associated data: a reasoning blob does not open as a compaction, nor the reverse)."""
        return self._seal("summary", summary, SUMMARY_ASSOCIATED)

    def open_summary(self, blob: str) -> str:
        """The summary a blob of `seal_summary` holds; SealError for anything else."""
        return self._open("summary", blob, SUMMARY_ASSOCIATED, "a compaction blob")

    def _seal(self, key: str, text: str, associated: bytes) -> str:
        nonce = secrets.token_bytes(NONCE_BYTES)
        payload = json.dumps({key: text}, ensure_ascii=False).encode()
        sealed = self._aead.encrypt(nonce, payload, associated)
        return base64.urlsafe_b64encode(VERSION + nonce + sealed).decode("ascii")

    def _open(self, key: str, blob: str, associated: bytes, what: str) -> str:
        not_ours = f"not {what} of this server"
        try:
            raw = base64.urlsafe_b64decode(blob.encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise SealError(not_ours) from None
        if len(raw) < 1 + NONCE_BYTES + 16 or raw[:1] != VERSION:
            raise SealError(not_ours)
        nonce, sealed = raw[1 : 1 + NONCE_BYTES], raw[1 + NONCE_BYTES :]
        try:
            payload = json.loads(self._aead.decrypt(nonce, sealed, associated))
        except InvalidTag:
            raise SealError("it was altered, or sealed by a server with another key") from None
        text = payload.get(key) if isinstance(payload, dict) else None
        if not isinstance(text, str):
            raise SealError(not_ours)
        return text
