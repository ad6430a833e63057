"""`oss-agent generate`: one prompt in, the model's answer out, no server.

Renders a Harmony conversation (system message with the reasoning effort, the user's prompt),
generates on one sequence until `<|return|>`/`<|call|>` or the token limit, and prints the
parsed messages: the final answer, and the reasoning with `--show-reasoning`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent_server import default_model
from agent_server.cli.serve import positive_int, unusable_device

MAX_TOKENS = 256  # with --model; the tiny random default gets default_model.MAX_OUTPUT_TOKENS


def temperature(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 2:  # (the APIs' range)
        raise argparse.ArgumentTypeError(f"must be between 0 and 2, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user's message")
    parser.add_argument("--model", help="HF gpt-oss checkpoint directory (default: a tiny random one)")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        help=f"most tokens to generate (default: {MAX_TOKENS}, or {default_model.MAX_OUTPUT_TOKENS} "
        "for the tiny random model used without --model)",
    )
    parser.add_argument("--temperature", type=temperature, default=0.0, help="0 means greedy (at most 2)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--reasoning-effort", choices=["low", "medium", "high"], default="medium")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--show-reasoning", action="store_true")


def run(args: argparse.Namespace) -> int:
    from openai_harmony import (
        Conversation,
        Message,
        ReasoningEffort,
        Role,
        StreamableParser,
        SystemContent,
    )

    from inference.config import ConfigError
    from inference.model.checkpoint import CheckpointError, checkpoint_folder_problem
    from inference.model.gpt_oss import GptOssModel
    from inference.model.tiny_checkpoint import default_tiny_checkpoint
    from inference.runner.single_sequence import generate
    from inference.tokenizer import ASSISTANT_STOP_TOKENS, VocabularyError, harmony_encoding

    model_dir = Path(args.model).expanduser() if args.model else default_tiny_checkpoint()
    try:  # a bad folder or file is the user's to fix: say which, no traceback
        problem = checkpoint_folder_problem(model_dir)
        if problem:
            raise ConfigError(f"--model {problem}")
        device_problem = unusable_device(args.device)
        if device_problem:
            raise ConfigError(f"--device {device_problem}")
        model = GptOssModel.from_pretrained(model_dir, device=args.device)
        encoding = harmony_encoding()
    except (ConfigError, CheckpointError, VocabularyError) as e:
        print(f"oss-agent generate: error: {e}", file=sys.stderr)
        return 2
    max_tokens = args.max_tokens or (MAX_TOKENS if args.model else default_model.MAX_OUTPUT_TOKENS)
    if not args.model:
        print(
            f"oss-agent generate: no --model given: a tiny checkpoint with random weights, so the text below is "
            f"noise (at most {max_tokens} tokens; --max-tokens for more). {default_model.REAL_WEIGHTS_HINT}",
            file=sys.stderr,
        )
    effort = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
    system = SystemContent.new().with_reasoning_effort(effort[args.reasoning_effort])
    conversation = Conversation.from_messages(
        [Message.from_role_and_content(Role.SYSTEM, system), Message.from_role_and_content(Role.USER, args.prompt)]
    )
    prompt = encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    tokens = generate(model, prompt, max_tokens, ASSISTANT_STOP_TOKENS, temperature=args.temperature, seed=args.seed)
    # A streaming parser tolerates output that stops mid-message (token limit, noise from a tiny model).
    parser = StreamableParser(encoding, role=Role.ASSISTANT)
    try:
        for token in tokens:
            parser.process(token)
    except Exception:  # malformed Harmony from the model: the raw text is printed below
        pass
    messages = list(parser.messages)
    for message in messages:
        text = "".join(part.text for part in message.content if hasattr(part, "text"))
        if message.channel == "final":
            print(text)
        elif args.show_reasoning:
            print(f"[{message.channel}] {text}", file=sys.stderr)
    if not any(m.channel == "final" for m in messages):
        # No complete final message (token limit, or a random-weight model's noise): show it all.
        print(encoding.decode(tokens))
    return 0
