"""Whose stored responses a request may see.

A response belongs to the owner of the API key that created it (auth.py names owners); with
keys configured, a request sees only its own owner's responses, and another owner's are
answered as missing. A server started with no key has one user, who sees every response.
"""

from __future__ import annotations


def visible(owner: str | None, requester: str | None) -> bool:
    """Whether a response of `owner` is the requester's to see (requester None: no keys)."""
    return requester is None or owner == requester
