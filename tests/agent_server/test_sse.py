"""`compact_json`, the serialiser of every streamed chunk: the same JSON as `json.dumps` with
compact separators, non-ASCII text as UTF-8, the characters str.splitlines cuts at escaped."""

from __future__ import annotations

import json
import math

from agent_server.sse import compact_json


def test_compact_json_is_json_dumps_for_ascii_and_the_same_value_for_the_rest():
    chunk = {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}],
        "usage": {"prompt_tokens": 3, "cost": 0.25},
        "flags": [True, False],
    }
    assert compact_json(chunk) == json.dumps(chunk, separators=(",", ":"))
    text = {"content": "é～\u2028\u2029\x85 ok", "logprob": -math.inf}
    written = compact_json(text)
    assert "é～" in written and not any(c in written for c in "\u2028\u2029\x85")
    assert len(written.splitlines()) == 1
    back = json.loads(written)
    assert back["content"] == text["content"] and back["logprob"] == -math.inf
