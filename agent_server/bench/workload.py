"""What a benchmark sends: prompts of chosen lengths, from random tokens or a dataset file.

Lengths are o200k token counts (the gpt-oss tokenizer). A random prompt of N tokens is N words
drawn from the vocabulary's lowercase ASCII word tokens (" apple", " rivers", ...): the
tokenizer splits text at each leading space, so N such tokens re-encode to exactly N tokens,
which `random_prompt` checks. The server adds its chat template (Harmony system message, role
markers) around the text; the input tokens it reports in `usage` include that.

Dataset files: JSON Lines, or one JSON array, of records that are either
    {"prompt": "...", "output_len": 128}          (output_len optional)
or ShareGPT-style conversations
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}
whose first user turn is the prompt and whose first assistant turn's length is the output length.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from agent_server.token_bytes import token_bytes
from inference.tokenizer import encode_text

WORD_TOKEN = re.compile(rb" [a-z]{2,12}")
ORDINARY_VOCAB = 199998  # o200k's ordinary tokens; specials start at 199999
DEFAULT_OUTPUT_LEN = 128


@dataclass
class BenchRequest:
    """One request of a workload: the user message and how many tokens to ask for."""

    prompt: str
    prompt_len: int  # o200k tokens of `prompt`
    output_len: int  # max_tokens / max_output_tokens to send


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    group.add_argument("--input-len", type=int, default=256, help="prompt tokens of each random prompt")
    group.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"output tokens to ask for (default {DEFAULT_OUTPUT_LEN}; with --dataset, the records' "
        "own lengths unless given)",
    )
    group.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly from [len*(1-r), len*(1+r)] (default 0: exact)",
    )
    group.add_argument(
        "--dataset",
        type=Path,
        help='JSON or JSONL of {"prompt", "output_len"} or ShareGPT records, instead of random prompts',
    )
    group.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="start every random prompt with the same N tokens (a shared system prompt, for the "
        "prefix cache and prefix routing; default 0)",
    )
    group.add_argument("--seed", type=int, default=0)


def workload_from_args(args: argparse.Namespace, *, num: int | None = None, seed_offset: int = 0) -> list[BenchRequest]:
    """The requests the arguments describe (`num` of them instead of --num-prompts if given;
    `seed_offset` draws other prompts of the same shape, e.g. for warm-up)."""
    seed, num = args.seed + seed_offset, args.num_prompts if num is None else num
    if args.dataset is not None:
        return dataset_requests(args.dataset, num, output_len=args.output_len, seed=seed)
    return random_requests(
        num,
        args.input_len,
        args.output_len or DEFAULT_OUTPUT_LEN,
        args.range_ratio,
        seed,
        shared_prefix_len=getattr(args, "shared_prefix_len", 0),
        prefix_seed=args.seed,
    )


@functools.lru_cache(maxsize=1)
def word_tokens() -> tuple[int, ...]:
    """Ordinary o200k tokens that are a space and 2-12 lowercase ASCII letters, each of which
    encodes back to itself even next to the others (checked once, on all of them together)."""
    ids = tuple(i for i in range(ORDINARY_VOCAB) if WORD_TOKEN.fullmatch(token_bytes(i)))
    text = "".join(token_bytes(i).decode() for i in ids)
    if encode_text(text) != list(ids):
        raise RuntimeError("the o200k word tokens do not re-encode to themselves; cannot build exact prompts")
    return ids


def random_prompt(rng: random.Random, length: int) -> str:
    """Text of exactly `length` o200k tokens, made of random word tokens."""
    if length < 1:
        raise ValueError("prompt length must be >= 1")
    pool = word_tokens()
    ids = [rng.choice(pool) for _ in range(length)]
    text = "".join(token_bytes(i).decode() for i in ids)
    counted = len(encode_text(text))
    if counted != length:  # cannot happen for word tokens (see word_tokens); fail loudly if it does
        raise RuntimeError(f"a random prompt of {length} tokens re-encoded to {counted}")
    return text


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    if not 0 <= ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    low, high = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    *,
    shared_prefix_len: int = 0,
    prefix_seed: int = 0,
) -> list[BenchRequest]:
    """`num` random prompts of about `input_len` tokens each, after a prefix of
    `shared_prefix_len` tokens that all share (drawn from `prefix_seed`, so a warm-up run with
    other prompts shares it too)."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if shared_prefix_len < 0:
        raise ValueError("--shared-prefix-len must be >= 0")
    prefix = random_prompt(random.Random(f"prefix-{prefix_seed}"), shared_prefix_len) if shared_prefix_len else ""
    rng = random.Random(seed)
    inputs = _lengths(rng, input_len, range_ratio, num)
    outputs = _lengths(rng, output_len, range_ratio, num)
    return [BenchRequest(prefix + random_prompt(rng, i), shared_prefix_len + i, o) for i, o in zip(inputs, outputs)]


def _read_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: every record must be a JSON object")
    return records


def _prompt_and_reply(record: dict) -> tuple[str | None, str | None, int | None]:
    """(prompt, reference reply, output_len) of one record; None where it has none."""
    if "prompt" in record:
        length = record.get("output_len")
        return record["prompt"], None, int(length) if length is not None else None
    turns = record.get("conversations") or record.get("messages") or []
    prompt = reply = None
    for turn in turns:
        who = turn.get("from") or turn.get("role")
        value = turn.get("value") if "value" in turn else turn.get("content")
        if prompt is None and who in ("human", "user"):
            prompt = value
        elif prompt is not None and who in ("gpt", "assistant"):
            reply = value
            break
    return prompt, reply, None


def dataset_requests(
    path: Path, num: int, *, output_len: int | None = None, default_output_len: int = DEFAULT_OUTPUT_LEN, seed: int = 0
) -> list[BenchRequest]:
    """`num` requests drawn (shuffled, with `seed`) from a dataset file; records without a
    prompt are skipped. The output length is `output_len` if given, else the record's
    `output_len` or its reference reply's token count, else `default_output_len`."""
    records = _read_records(Path(path))
    random.Random(seed).shuffle(records)
    requests = []
    for record in records:
        prompt, reply, length = _prompt_and_reply(record)
        if not isinstance(prompt, str) or not prompt:
            continue
        if output_len is not None:
            length = output_len
        elif length is None:
            length = len(encode_text(reply)) if isinstance(reply, str) and reply else default_output_len
        requests.append(BenchRequest(prompt, len(encode_text(prompt)), max(1, length)))
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"{path}: no usable prompts")
    if len(requests) < num:  # a small file is cycled so --num-prompts holds
        requests = [requests[i % len(requests)] for i in range(num)]
    return requests
