"""The Harmony layer shared by both APIs: prompts in, parsed model messages out.

Rendering: the system message (reasoning effort, built-in tool namespaces), the developer
message (instructions, function tools, response format) and the conversation become token ids
through openai-harmony. Parsing: `HarmonyStream` wraps openai-harmony's `StreamableParser` and
turns generated tokens into message start / content / end events. The model's output is not
trusted: a malformed header or stray tokens close the current message as *malformed* and the
parser resynchronises at the next `<|start|>`, so the text is kept and the request finishes.
"""

from __future__ import annotations

import codecs
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyError,
    Message,
    ReasoningEffort,
    RenderConversationConfig,
    Role,
    StreamableParser,
    SystemContent,
    TextContent,
    ToolDescription,
    ToolNamespaceConfig,
)

from agent_server.token_bytes import is_special, token_bytes
from inference.tokenizer import CALL, END, MESSAGE, RETURN, START, encode_text, harmony_encoding

# Real headers ("<|channel|>commentary to=functions.name <|constrain|>json") are far shorter;
# past this the output is not Harmony and is streamed as malformed text instead of buffered.
MAX_HEADER_TOKENS = 48

EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}


@dataclass
class PromptConfig:
    """Everything that goes into the system and developer messages."""

    reasoning_effort: str = "medium"
    instructions: str | None = None
    function_tools: list[ToolDescription] = field(default_factory=list)
    # Built-in and MCP namespaces (browser, python, ...) described in the system message.
    tool_namespaces: list[ToolNamespaceConfig] = field(default_factory=list)
    # {"name", "schema", "description"} for structured output, or None.
    response_format: dict[str, Any] | None = None
    conversation_start_date: str | None = None


# `verbosity` (text.verbosity, Chat's verbosity): gpt-oss has no setting for it, so the wish is
# said in the developer message; "medium", the default, adds nothing.
VERBOSITY_NOTES = {
    "low": "Keep your final answer short: say only what is needed.",
    "high": "Give a thorough, detailed final answer.",
}


def verbosity_note(verbosity: str | None) -> str | None:
    return VERBOSITY_NOTES.get(verbosity or "medium")


def system_message(config: PromptConfig) -> Message:
    content = SystemContent.new().with_reasoning_effort(EFFORTS[config.reasoning_effort])
    if config.conversation_start_date:
        content = content.with_conversation_start_date(config.conversation_start_date)
    for namespace in config.tool_namespaces:
        content = content.with_tools(namespace)
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer_message(config: PromptConfig) -> Message | None:
    """Instructions, function tools and response format, or None when there are none."""
    instructions = config.instructions or ""
    if config.response_format is not None:
        fmt = config.response_format
        section = f"# Response Formats\n\n## {fmt['name']}\n\n"
        if fmt.get("description"):
            section += f"// {fmt['description']}\n"
        if fmt.get("schema") is not None:
            section += json.dumps(fmt["schema"], separators=(",", ":"))
        instructions = f"{instructions}\n\n{section}" if instructions else section
    if not instructions and not config.function_tools:
        return None
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if config.function_tools:
        content = content.with_function_tools(config.function_tools)
    return Message.from_role_and_content(Role.DEVELOPER, content)


def preamble(config: PromptConfig) -> list[Message]:
    developer = developer_message(config)
    return [system_message(config)] + ([developer] if developer else [])


def render_prompt(messages: list[Message], keep_analysis: bool = False) -> list[int]:
    """Token ids of the conversation followed by `<|start|>assistant`, ready to generate.

    Analysis messages of turns that ended in a final answer are dropped, as gpt-oss expects,
    unless `keep_analysis` (reasoning.context "all_turns": the model sees all its reasoning).
    The leading system and developer messages are rendered once per distinct content and reused
    (`PreambleTokens`): most requests share them, and rendering them was a third of a request's
    rendering (two thirds with the browser and python tools described in the system message).
    """
    lead = 0
    while lead < min(2, len(messages) - 1) and messages[lead].author.role in (Role.SYSTEM, Role.DEVELOPER):
        lead += 1
    if any(m.author.role in (Role.SYSTEM, Role.DEVELOPER) for m in messages[lead:]):
        lead = 0  # a later one could change how the preamble renders: render it all as one
    head = _preamble_tokens.get(messages[:lead]) if lead else []
    texts = [_plain_user_text(m) for m in messages[lead:]]
    if all(text is not None for text in texts):  # the common request: no earlier assistant turns
        return head + [t for text in texts for t in _user_message_tokens(text)] + assistant_start_tokens()
    kept = messages[lead:] if keep_analysis else _without_finished_analysis(messages[lead:])
    conversation = Conversation.from_messages(kept)
    config = RenderConversationConfig(auto_drop_analysis=not keep_analysis)
    return head + harmony_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT, config)


def _without_finished_analysis(messages: list[Message]) -> list[Message]:
    """The messages without the analysis of every turn that ended in a final answer (those before
    the last final message), and without the answers of the tool calls dropped with it.

    openai-harmony's `auto_drop_analysis` only drops analysis before the *first* final message,
    and keeps the tool messages answering a dropped analysis-channel call (browser, python):
    the model would read tool answers nobody asked for."""
    last_final = max(
        (i for i, m in enumerate(messages) if m.author.role == Role.ASSISTANT and m.channel == "final"), default=-1
    )
    kept: list[Message] = []
    unanswered: list[str] = []  # recipients of dropped calls, whose answers go too
    for i, message in enumerate(messages):
        role = message.author.role
        if i < last_final and role == Role.ASSISTANT and message.channel == "analysis":
            if message.recipient:
                unanswered.append(message.recipient)
            continue
        if role == Role.TOOL and message.author.name in unanswered:
            unanswered.remove(message.author.name)
            continue
        if role != Role.TOOL and not (role == Role.ASSISTANT and message.recipient):
            unanswered = []  # an answer comes right after its calls
        kept.append(message)
    return kept


def _plain_user_text(message: Message) -> str | None:
    """The text of a user message that renders as `<|start|>user<|message|>TEXT<|end|>`, else None."""
    if (
        message.author.role == Role.USER
        and message.author.name is None
        and message.channel is None
        and message.recipient is None
        and message.content_type is None
        and len(message.content) == 1
        and isinstance(message.content[0], TextContent)
    ):
        return message.content[0].text
    return None


def _user_message_tokens(text: str) -> list[int]:
    """A plain user message rendered by hand, as openai-harmony renders it (its tests check
    that), at the cost of the text's tokenisation alone: openai-harmony's render spends about
    0.1 ms a call besides (CPU, 0.0.8), on the path to the first token."""
    return [START, *encode_text("user"), MESSAGE, *encode_text(text), END]


class PreambleTokens:
    """Rendered preambles (the leading system and developer messages) by content, the least
    recently used dropped past `size`. Rendered as a conversation of their own: the system
    message's text depends on the developer message (function tools add a line about the
    commentary channel), and nothing after them depends on either."""

    def __init__(self, size: int = 64):
        self.size = size
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()

    def get(self, messages: list[Message]) -> list[int]:
        key = json.dumps([m.to_dict() for m in messages], sort_keys=True, default=str)  # every field, tools too
        tokens = self._tokens.get(key)
        if tokens is None:
            tokens = self._tokens[key] = harmony_encoding().render_conversation(Conversation.from_messages(messages))
            if len(self._tokens) > self.size:
                self._tokens.popitem(last=False)
        else:
            self._tokens.move_to_end(key)
        return list(tokens)


_preamble_tokens = PreambleTokens()


def assistant_start_tokens() -> list[int]:
    return [START, *encode_text("assistant")]


def tool_message(author: str, text: str) -> Message:
    """A tool's answer to the assistant, e.g. author "browser.search" or "python"."""
    return (
        Message.from_author_and_content(Author.new(Role.TOOL, author), text)
        .with_channel("commentary")
        .with_recipient("assistant")
    )


def continuation_tokens(messages: list[Message]) -> list[int]:
    """Tokens to append after a turn that ended in `<|call|>`: the tool messages, then
    `<|start|>assistant` so the model answers them on the same sequence."""
    encoding = harmony_encoding()
    return [t for message in messages for t in encoding.render(message)] + assistant_start_tokens()


def message_text(message: Message) -> str:
    return "".join(getattr(part, "text", "") for part in message.content)


# --- parsing generated tokens ---------------------------------------------------------------


@dataclass
class MessageStart:
    channel: str | None
    recipient: str | None
    content_type: str | None
    malformed: bool = False


@dataclass
class ContentDelta:
    text: str


@dataclass
class MessageEnd:
    """A finished message. `malformed` explains what was wrong when the model broke Harmony."""

    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str
    num_tokens: int  # tokens of this message, header and end token included
    malformed: str | None = None
    truncated: bool = False  # cut off by the token limit or an abort

    def to_message(self) -> Message:
        """The message as it goes back into a later prompt."""
        message = Message.from_role_and_content(Role.ASSISTANT, self.text)
        if self.channel:
            message = message.with_channel(self.channel)
        if self.recipient:
            message = message.with_recipient(self.recipient)
        if self.content_type:
            message = message.with_content_type(self.content_type)
        return message


HarmonyEvent = MessageStart | ContentDelta | MessageEnd


class HarmonyStream:
    """Incremental, forgiving parse of an assistant turn (the tokens after `<|start|>assistant`).

    `feed(token)` returns the events that token caused; `finish()` closes whatever is open.
    Every token fed belongs to exactly one message, so `MessageEnd.num_tokens` adds up to the
    tokens generated (reasoning tokens are those of `analysis` messages), but for a header the
    turn ends in, which `finish` drops (`dropped_tokens`).

    Cost per token is O(1): the parser's `state` and `messages` serialise everything parsed so
    far, so the header/content position is followed from the token ids themselves (the parser
    still validates every token) and finished messages are read once, at their end token.
    """

    def __init__(self, role: Role | None = Role.ASSISTANT):
        self.encoding = harmony_encoding()
        self.parser = StreamableParser(self.encoding, role, strict=True)
        self.in_content = False  # past this message's <|message|>
        self.started: MessageStart | None = None  # the message being streamed, if any
        self.message_tokens: list[int] = []  # tokens of the current message so far
        self.streamed = ""  # the current message's text given out in deltas so far
        self.raw: list[int] | None = None  # tokens of a malformed stretch being recovered
        self.raw_text = ""
        self.raw_error = ""
        self.raw_decoder = None
        self.dropped_tokens = 0  # of a header the turn ended in (`finish`)

    # -- the normal path

    def feed(self, token: int) -> list[HarmonyEvent]:
        if self.raw is not None:
            return self._feed_raw(token)
        self.message_tokens.append(token)
        try:
            self.parser.process(token)
        except HarmonyError as e:
            return self._start_raw(str(e))
        if self.in_content:
            if token in (END, RETURN, CALL):
                return self._ended(self.parser.messages[-1])
            delta = self.parser.last_content_delta
            if not delta:
                return []
            self.streamed += delta
            return [ContentDelta(delta)]
        if token == MESSAGE:
            self.in_content = True
            p = self.parser
            self.started = MessageStart(p.current_channel, p.current_recipient, p.current_content_type)
            return [self.started]
        if len(self.message_tokens) > MAX_HEADER_TOKENS:
            return self._start_raw(f"message header longer than {MAX_HEADER_TOKENS} tokens")
        return []

    def _ended(self, message: Message, truncated: bool = False) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        text = message_text(message)
        if self.started is None:  # a message that never reached <|message|> (no content)
            self.started = MessageStart(message.channel, message.recipient, message.content_type)
            events.append(self.started)
            if text:
                events.append(ContentDelta(text))
        elif text != self.streamed and text.startswith(self.streamed):
            # The deltas hold back a character split over tokens; a message that ends inside one
            # ends with its replacement character, in its text and so in its last delta (a
            # code cell's streamed code is then the code that runs).
            events.append(ContentDelta(text[len(self.streamed) :]))
        events.append(
            MessageEnd(
                message.channel,
                message.recipient,
                message.content_type,
                text,
                len(self.message_tokens),
                truncated=truncated,
            )
        )
        self.started, self.message_tokens, self.in_content, self.streamed = None, [], False, ""
        return events

    def finish(self) -> list[HarmonyEvent]:
        """The turn is over (stop token, token limit or abort): close what is still open."""
        if self.raw is not None:
            return self._end_raw(truncated=True)
        if not self.message_tokens:
            return []
        if self._cut_header():  # nothing a client could read: dropped, not shown as markup
            self.dropped_tokens, self.message_tokens = len(self.message_tokens), []
            return []
        try:
            self.parser.process_eos()
        except HarmonyError as e:
            return self._start_raw(str(e), ending=True)
        if self.in_content:
            return self._ended(self.parser.messages[-1], truncated=True)
        return self._start_raw("the turn ended inside a message header", ending=True)

    def _cut_header(self) -> bool:
        """The turn ends before this message's <|message|>, and what came is a header (it has a
        Harmony token): the token limit or an abort cut the next message before any content."""
        tokens = self.message_tokens
        return (
            not self.in_content
            and self.started is None
            and any(is_special(t) for t in tokens)
            and not any(t in (END, RETURN, CALL) for t in tokens)
        )  # (an ended one is malformed)

    # -- recovery from malformed output

    def _start_raw(self, error: str, ending: bool = False) -> list[HarmonyEvent]:
        """Parsing failed: keep this message's tokens as text of a malformed message."""
        events: list[HarmonyEvent] = []
        tokens = self.message_tokens
        if self.started is not None:
            # Content already streamed stays what it was; the rest joins the malformed stretch.
            streamed = self.parser.current_content
            events.append(
                MessageEnd(
                    self.started.channel,
                    self.started.recipient,
                    self.started.content_type,
                    streamed,
                    len(tokens) - 1,
                    malformed=error,
                )
            )
            tokens = tokens[-1:]
            self.started = None
        self.raw, self.raw_error, self.raw_text, self.message_tokens = [], error, "", []
        self.in_content, self.streamed = False, ""
        self.raw_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        events.append(MessageStart(None, None, None, malformed=True))
        if ending:
            for token in tokens:
                events += self._feed_raw(token, close_on_stop=False)
            return events + self._end_raw(truncated=True)
        for token in tokens[:-1]:
            events += self._feed_raw(token, close_on_stop=False)
        # The offending token may itself end the stretch (a stop token) or open a new message.
        return events + (self._feed_raw(tokens[-1]) if tokens else [])

    def _feed_raw(self, token: int, close_on_stop: bool = True) -> list[HarmonyEvent]:
        if close_on_stop and token == START:
            events = self._end_raw()
            self.parser = StreamableParser(self.encoding, None, strict=True)
            return events + self.feed(token)
        self.raw.append(token)
        if close_on_stop and token in (END, RETURN, CALL):
            return self._end_raw()
        if is_special(token):  # Harmony's markup is not the model's text
            return []
        delta = self.raw_decoder.decode(token_bytes(token))
        self.raw_text += delta
        return [ContentDelta(delta)] if delta else []

    def _end_raw(self, truncated: bool = False) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        rest = self.raw_decoder.decode(b"", final=True)  # a dangling partial character
        if rest:
            self.raw_text += rest
            events.append(ContentDelta(rest))
        events.append(
            MessageEnd(None, None, None, self.raw_text, len(self.raw), malformed=self.raw_error, truncated=truncated)
        )
        self.raw = None
        self.raw_text = ""
        self.message_tokens = []
        # What follows a closed malformed stretch must open a new message.
        self.parser = StreamableParser(self.encoding, None, strict=True)
        return events


def recipient_kind(recipient: str | None) -> tuple[str, str]:
    """Split a recipient into (namespace, tool name): "functions.get_weather" ->
    ("functions", "get_weather"), "browser.search" -> ("browser", "search"), "python" ->
    ("python", "")."""
    if not recipient:
        return "", ""
    recipient = recipient.strip()
    namespace, _, name = recipient.partition(".")
    return namespace, name
