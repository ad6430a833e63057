"""Compaction: the model summarises a conversation into one item that stands for it.

`POST /v1/responses/compact` returns the conversation's user messages (and its system and
developer input messages) followed by a `compaction` item; a later request sends those as
`input` instead of the history. The item carries the model's summary sealed under the server's
key (`ReasoningSeal.seal_summary`): as input it becomes an assistant message holding the
summary (`summary_message`), after the user messages that were kept. `context_management`
with a `compact_threshold` does the same inside a create: when the prompt passes the threshold,
the conversation before the message being answered is compacted first, the response's output
starts with the compaction item, and the response runs on the compacted conversation.

The summarising pass is an ordinary generation: the conversation as the model saw it (the
request's instructions, no tools, low reasoning effort), then a user message asking for the
summary (`COMPACTION_REQUEST`). The summary is the text of the model's final answer.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from openai.types.responses import ResponseCompactionCompactingEvent, ResponseCompactionItem
from openai_harmony import Message, Role

from agent_server.errors import APIError
from agent_server.harmony import HarmonyStream, MessageEnd, PromptConfig, message_text, preamble, render_prompt
from agent_server.metrics import Metrics
from agent_server.responses.events import ResponseEvents, new_id
from inference.request import EngineClient, GenerationRequest, SamplingParams
from inference.tokenizer import CALL, RETURN

log = logging.getLogger(__name__)

COMPACTION_REQUEST = (
    "Compact this conversation: write a summary that will replace everything in it except the user's messages, "
    "which are kept as they are. Say what the user wants, what has been done and found so far (tool calls and "
    "their results included), what was decided, and what remains to do, with every detail needed to carry on: "
    "names, numbers, paths, code. Write only the summary, as notes for yourself."
)
# How the summary reads to the model when a compaction item comes back as input.
SUMMARY_PREFIX = "Summary of the conversation so far (its earlier messages were compacted into it):\n\n"
MAX_SUMMARY_TOKENS = 2048


class CompactionFailed(Exception):
    """The engine failed while the model wrote the summary."""


@dataclass
class Summary:
    text: str
    usage: dict[str, int] = field(default_factory=lambda: dict(input=0, cached=0, output=0, reasoning=0))


def summary_message(summary: str) -> Message:
    """What a compaction item stands for in a prompt: the model's summary, as its own words."""
    return Message.from_role_and_content(Role.ASSISTANT, SUMMARY_PREFIX + summary).with_channel("final")


def compacted(conversation: list[Message], summary: str) -> list[Message]:
    """What compaction leaves of `conversation`: its user messages, then the summary."""
    return [m for m in conversation if m.author.role == Role.USER] + [summary_message(summary)]


def split_for_compaction(conversation: list[Message]) -> tuple[list[Message], list[Message]] | None:
    """(what to compact, what follows it unchanged): everything before the last message when that
    is the user's (the turn to answer), else everything; None when there would be nothing to
    compact but user messages (they are kept anyway)."""
    cut = len(conversation) - 1 if conversation and conversation[-1].author.role == Role.USER else len(conversation)
    older = conversation[:cut]
    if not any(m.author.role != Role.USER for m in older):
        return None
    return older, conversation[cut:]


def summary_prompt(conversation: list[Message], instructions: str | None) -> list[int]:
    head = preamble(
        PromptConfig(
            reasoning_effort="low", instructions=instructions, conversation_start_date=datetime.date.today().isoformat()
        )
    )
    return render_prompt(head + conversation + [Message.from_role_and_content(Role.USER, COMPACTION_REQUEST)])


async def summarise(
    engine: EngineClient,
    conversation: list[Message],
    instructions: str | None,
    request_id: str,
    *,
    max_tokens: int | None = None,
    metrics: Metrics | None = None,
) -> Summary:
    """The model's summary of `conversation`. APIError (400) when the conversation leaves no
    room to write one; CompactionFailed when the engine fails."""
    prompt = summary_prompt(conversation, instructions)
    room = engine.max_model_len - len(prompt)
    if room <= 0:
        raise APIError(
            f"The conversation to compact is {len(prompt)} tokens with the compaction request; this "
            f"model's context is {engine.max_model_len} tokens.",
            param="input",
            code="context_length_exceeded",
        )
    budget = min(room, MAX_SUMMARY_TOKENS, max_tokens or MAX_SUMMARY_TOKENS)
    sampling = SamplingParams(max_tokens=budget, stop_token_ids=[RETURN, CALL])
    deltas = engine.generate(GenerationRequest(request_id, prompt, sampling))
    if metrics is not None:
        deltas = metrics.observe_generation(deltas, None)
    summary, parser, ended = Summary(""), HarmonyStream(), []
    finish = error = None
    try:
        async for delta in deltas:
            summary.usage["input"], summary.usage["cached"] = delta.num_prompt_tokens, delta.num_cached_tokens
            for token in delta.token_ids:
                summary.usage["output"] += 1
                ended += [e for e in parser.feed(token) if isinstance(e, MessageEnd)]
            if delta.finish_reason is not None:
                finish, error = delta.finish_reason, delta.error
    finally:
        if finish is None:  # cancelled, or the stream broke off
            engine.abort(request_id)
    if finish == "error" or finish == "abort":
        log.error("compaction %s: generation failed: %s", request_id, error or finish)
        raise CompactionFailed(error or finish)
    ended += [e for e in parser.finish() if isinstance(e, MessageEnd)]
    summary.usage["reasoning"] = sum(e.num_tokens for e in ended if e.channel == "analysis")
    answer = [e.text for e in ended if e.channel == "final"]
    # A model that never reached a final answer (the token limit, random weights): what it wrote
    # outside its reasoning stands for the summary.
    summary.text = "".join(answer or [e.text for e in ended if e.channel != "analysis" and not e.recipient])
    return summary


def compaction_item(seal: Callable[[str], str], summary: str) -> dict[str, Any]:
    return {"id": new_id("cmp"), "type": "compaction", "encrypted_content": seal(summary)}


def kept_items(instructions: list[str], conversation: list[Message]) -> list[dict[str, Any]]:
    """The items a compaction keeps, as the compact endpoint returns them: the system and
    developer input messages (as developer messages), then every user message."""
    texts = [("developer", text) for text in instructions]
    texts += [("user", message_text(m)) for m in conversation if m.author.role == Role.USER]
    return [
        {
            "id": new_id("msg"),
            "type": "message",
            "role": role,
            "status": "completed",
            "content": [{"type": "input_text", "text": text}],
        }
        for role, text in texts
    ]


def usage_json(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["input"],
        "input_tokens_details": {"cached_tokens": usage["cached"]},
        "output_tokens": usage["output"],
        "output_tokens_details": {"reasoning_tokens": usage["reasoning"]},
        "total_tokens": usage["input"] + usage["output"],
    }


class CompactionWriter:
    """The `compaction` output item of a response that compacted its conversation first:
    added while the model writes the summary, done with the summary sealed."""

    def __init__(self, events: ResponseEvents):
        self.events = events
        self.item = ResponseCompactionItem(id=new_id("cmp"), type="compaction", encrypted_content="")
        self.index = events.add_item(self.item)
        events.emit(ResponseCompactionCompactingEvent, item_id=self.item.id, output_index=self.index)

    def done(self, encrypted_content: str) -> None:
        self.item.encrypted_content = encrypted_content
        self.events.item_done(self.index)
