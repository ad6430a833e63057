"""Whose stored responses and conversations a request may see.

A response or a conversation belongs to the owner of the API key that created it (auth.py names
owners); with keys configured, a request sees only its own owner's, and another owner's are
answered as missing (404, as OpenAI answers for another organisation's). A server started with
no key has one user, who sees everything.
"""

from __future__ import annotations


def visible(owner: str | None, requester: str | None) -> bool:
    """Whether a response or conversation of `owner` is the requester's to see (requester None:
    no keys)."""
    return requester is None or owner == requester
