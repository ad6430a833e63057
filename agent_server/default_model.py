"""The model served when no --model is given: a tiny checkpoint with random weights.

Everything works on it without a download, but the text it writes is noise, and left alone it
writes until its context is full (minutes on a CPU). So it answers at most a few dozen tokens
unless a request asks for more, it also answers to the real models' names (so examples written
for them run unchanged), and every place a newcomer looks says what it is and how to get real
weights.
"""

from __future__ import annotations

NAME = "gpt-oss-tiny-random"
# The real models' ids, which the README and examples use: the tiny model answers them too.
STAND_IN_FOR = ("gpt-oss-20b", "gpt-oss-120b")
# Output tokens a request that sets no limit gets (a second or two on a CPU).
MAX_OUTPUT_TOKENS = 48
REAL_WEIGHTS_HINT = (
    "For real answers, download a gpt-oss checkpoint (pip install huggingface_hub; hf download "
    "openai/gpt-oss-20b --exclude 'original/*' 'metal/*' --local-dir gpt-oss-20b) and pass "
    "--model gpt-oss-20b."
)


def notice(max_output_tokens: int | None) -> str:
    """What the server's log says about the tiny model at startup."""
    limit = (
        f"a request that sets no max_output_tokens / max_tokens gets at most {max_output_tokens} output tokens "
        "(--default-max-output-tokens changes it)"
        if max_output_tokens
        else "requests that set no token limit write until the context is full"
    )
    return (
        f"No --model given: serving {NAME}, a tiny checkpoint with random weights. Everything works, but the "
        f"text it writes is noise; {limit}. It also answers requests for {' and '.join(STAND_IN_FOR)}. "
        + REAL_WEIGHTS_HINT
    )
