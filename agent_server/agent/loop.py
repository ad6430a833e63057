"""The Responses agent loop: generate, parse Harmony, run built-in tools, continue.

    prompt = render(system, developer, conversation)
    loop:
        generate one assistant turn (stops at <|return|> or <|call|>), streaming each Harmony
        message into its output item as it is parsed:
            analysis            -> reasoning
            final / commentary  -> message (output_text, browser citations as annotations)
            to=a tool           -> that tool's call item (`agent_server/agent/tool_items.py`);
                                   a function call is the client's to run: the response stops
        on a built-in call: run the tool, append its answer to the *same* token sequence and
        continue on the engine's parked KV cache (only the tool message is prefilled)
    until a final answer, a function call, max_tool_calls or max_output_tokens.

Malformed Harmony never fails a response: the text becomes a message marked `incomplete`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from openai.types.responses import ResponseUsage
from openai_harmony import Message

from agent_server.agent.tool_items import ToolCallItem, open_tool_item
from agent_server.agent.tool_registry import ActiveTools, Route, ToolSessions
from agent_server.errors import internal_error
from agent_server.harmony import (
    ContentDelta,
    HarmonyStream,
    MessageEnd,
    MessageStart,
    continuation_tokens,
    tool_message,
)
from agent_server.metrics import Metrics
from agent_server.responses.events import McpListToolsWriter, MessageWriter, ReasoningWriter, ResponseEvents
from agent_server.token_bytes import is_special, logprob_entry
from agent_server.tokenization_cost import fit_tokenization_budget
from agent_server.turn_grammar import TurnRules
from inference.request import EngineClient, GenerationRequest, SamplingParams
from inference.tokenizer import CALL, RETURN
from tools.browser.citation_stream import CitationStreamer
from tools.browser.citations import resolve_citations

log = logging.getLogger(__name__)


@dataclass
class AgentTask:
    """One response's work, prepared from the request by the HTTP layer."""

    response_id: str
    prompt: list[int]  # the rendered Harmony conversation, ending in <|start|>assistant
    tools: ActiveTools
    sampling: SamplingParams
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    include: set[str] = field(default_factory=set)
    container_id: str = ""
    list_mcp_servers: list[str] = field(default_factory=list)  # Harmony namespaces to list first
    started: float | None = None  # perf_counter() at request arrival, for time to first token
    tool_timeout: float = 300.0
    # False: at most one function call per response. Harmony lets the model chain several calls
    # in one turn (`<|end|>` between them), so the turn is cut after the first one.
    parallel_tool_calls: bool = True
    # include "reasoning.encrypted_content": seals a reasoning item's analysis for the client.
    seal_reasoning: Callable[[str], str] | None = None
    # include "message.output_text.logprobs": how many alternatives each answer token lists
    # (`sampling.logprobs` asks the engine for them).
    top_logprobs: int | None = None
    # The grammar each turn is held to (the first one to a forced call, if any); None: none.
    rules: TurnRules | None = None


@dataclass
class AgentOutcome:
    status: str  # completed | incomplete | failed | cancelled
    incomplete_reason: str | None = None
    error: str | None = None
    new_messages: list[Message] = field(default_factory=list)  # assistant and tool messages, in order
    function_calls: dict[str, str] = field(default_factory=dict)  # call_id -> name, made this response


@dataclass
class PendingCall:
    route: Route
    recipient: str
    arguments: str
    item: ToolCallItem


class AgentLoop:
    def __init__(
        self,
        engine: EngineClient,
        task: AgentTask,
        events: ResponseEvents,
        sessions: ToolSessions,
        metrics: Metrics | None = None,
        on_engine_start: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.on_engine_start = on_engine_start  # called once, when the first request reaches the engine
        self.task = task
        self.events = events
        self.sessions = sessions
        self.metrics = metrics
        self.outcome = AgentOutcome(status="in_progress")
        self.writer: Any = None  # the item being streamed
        self.route: Route | None = None
        self.citations: CitationStreamer | None = None
        self.calls: list[PendingCall] = []
        self.tool_calls_made = 0
        self.turn_over = False  # set when the turn must end before the model ends it
        self.request_id: str | None = None  # the engine request running now
        self.usage = dict(input=0, cached=0, output=0, reasoning=0)
        self.logprobs: list[dict[str, Any]] = []  # entries of message tokens whose text is not written yet

    async def run(self) -> AgentOutcome:
        try:
            await self._run()
        except asyncio.CancelledError:
            self._close_open_item("incomplete")
            self.outcome.status = "cancelled"
        except Exception:  # a bug or an engine failure: the response fails, the server lives on
            log.exception("response %s failed", self.task.response_id)
            self._close_open_item("incomplete")
            self.outcome.status, self.outcome.error = "failed", internal_error().message
        finally:
            if self.request_id is not None and self.task.tools.any_builtin:
                self.engine.release(self.request_id)
        self._set_usage()
        return self.outcome

    async def _run(self) -> None:
        task = self.task
        for namespace in task.list_mcp_servers:
            binding = task.tools.mcp[namespace]
            McpListToolsWriter(
                self.events,
                binding.label,
                [
                    {"name": t.name, "description": t.description, "input_schema": t.parameters or {}}
                    for t in binding.namespace.tools
                ],
            )
        tokens = list(task.prompt)
        parked: str | None = None
        turn = 0
        while True:
            request_id = f"{task.response_id}/{turn}"
            generated, finish, error = await self._generate(tokens, request_id, parked, first=turn == 0)
            if parked is not None:
                self.engine.release(parked)  # a no-op when the continuation took its pages over
            parked = request_id
            if finish != "stop":
                self._close_open_item("incomplete")
                if finish == "length":
                    self.outcome.status, self.outcome.incomplete_reason = "incomplete", "max_output_tokens"
                elif finish == "error":  # the engine's reason goes to the log, not to the client
                    log.error("response %s: generation failed: %s", task.response_id, error)
                    self.outcome.status, self.outcome.error = "failed", internal_error().message
                else:
                    self.outcome.status = "cancelled"
                return
            builtin = [c for c in self.calls if c.item.runs_here]
            if not builtin or generated[-1] != CALL:  # a final answer, or function calls for the client
                self._close_open_item("incomplete")  # (a call the model did not end with <|call|>)
                self.outcome.status = "completed"
                return
            functions = any(not c.item.runs_here for c in self.calls)
            tool_messages = [await self._run_tool(call) for call in builtin]
            self.calls = []
            self.outcome.new_messages += tool_messages
            if functions:  # the client runs those: the model must not answer before it has
                self.outcome.status = "completed"
                return
            # The next turn continues the same sequence: the engine prefills the tool answers only.
            tokens = tokens + generated + continuation_tokens(tool_messages)
            turn += 1

    # -- one assistant turn ------------------------------------------------------------------

    async def _generate(self, prompt: list[int], request_id: str, parked: str | None, first: bool):
        """Generate until a stop token; returns (generated tokens, finish reason, error)."""
        budget = self.engine.max_model_len - len(prompt)
        if self.task.max_output_tokens is not None:
            budget = min(budget, self.task.max_output_tokens - self.usage["output"])
        if budget <= 0:
            return [], "length", None
        grammar = self.task.rules.grammar(forced=first, budget=budget) if self.task.rules is not None else None
        sampling = replace(self.task.sampling, max_tokens=budget, stop_token_ids=[RETURN, CALL], grammar=grammar)
        request = GenerationRequest(
            request_id, prompt, sampling, keep_alive=self.task.tools.any_builtin, continue_from=parked
        )
        self.request_id = request_id
        deltas = self.engine.generate(request)
        deltas.open()  # the engine prefills while the parser is built
        if self.on_engine_start is not None:
            self.on_engine_start()
            self.on_engine_start = None
        stream = HarmonyStream()
        generated: list[int] = []
        finish, error, counted, cut = None, None, False, False
        if self.metrics is not None:
            deltas = self.metrics.observe_generation(deltas, self.task.started if first else None)
        try:
            async for delta in deltas:
                if not counted:
                    self.usage["input"] += delta.num_prompt_tokens
                    self.usage["cached"] += delta.num_cached_tokens
                    counted = True
                for i, token in enumerate(delta.token_ids):
                    generated.append(token)
                    self.usage["output"] += 1
                    if delta.logprobs and self.task.top_logprobs is not None:
                        self._keep_logprob(token, delta.logprobs[i])
                    self._on_events(stream.feed(token))
                    if self.turn_over:  # nothing the model says after this counts
                        break
                if self.turn_over and delta.finish_reason is None:
                    cut = True  # end the turn here, as if the model had stopped
                    break
                if delta.finish_reason is not None:
                    finish, error = delta.finish_reason, delta.error
                    # Engines may leave the stop token out of token_ids; the sequence has it.
                    if (
                        finish == "stop"
                        and delta.stop_token_id is not None
                        and (not generated or generated[-1] != delta.stop_token_id)
                    ):
                        generated.append(delta.stop_token_id)
                        self._on_events(stream.feed(delta.stop_token_id))
        except BaseException:
            self.engine.abort(request_id)
            raise
        if cut:
            self.engine.abort(request_id)
            await deltas.aclose()
            finish = "stop"
        self._on_events(stream.finish())
        return generated, finish or "abort", error

    def _on_events(self, events) -> None:
        for event in events:
            if isinstance(event, MessageStart):
                self._start_item(event)
            elif isinstance(event, ContentDelta):
                self._delta(event.text)
            elif isinstance(event, MessageEnd):
                self._end_item(event)

    def _start_item(self, start: MessageStart) -> None:
        self.route = None
        if start.malformed:
            self.writer = MessageWriter(self.events)
        elif start.recipient:
            self.route = self.task.tools.route(start.recipient)
            item = open_tool_item(self.events, self.route, self.task.container_id)
            # A tool that does not exist: keep the text, mark the item.
            self.writer = item if item is not None else MessageWriter(self.events)
        elif start.channel == "analysis":
            self.writer = ReasoningWriter(self.events, seal=self.task.seal_reasoning)
        else:
            phase = {"final": "final_answer", "commentary": "commentary"}.get(start.channel or "")
            self.writer = MessageWriter(self.events, phase=phase)
            if start.channel == "final":
                session = self.sessions.opened(self.task.tools.browser)
                if session is not None:
                    self.citations = CitationStreamer(session.resolve_citations)
                elif self.task.tools.browser is not None:  # marks of pages this response never opened
                    self.citations = CitationStreamer(lambda text: resolve_citations(text, []))
                else:
                    self.citations = CitationStreamer(None)

    def _keep_logprob(self, token: int, logprob: Any) -> None:
        """A message token's logprob, written with the next text of the message (its text may
        come with a later token: a character split over tokens, a held-back citation)."""
        if isinstance(self.writer, MessageWriter) and not is_special(token):
            self.logprobs.append(logprob_entry(token, logprob.logprob, logprob.top, self.task.top_logprobs))

    def _message_delta(self, text: str) -> None:
        if text:
            logprobs, self.logprobs = self.logprobs, []
            self.writer.delta(text, logprobs)

    def _delta(self, text: str) -> None:
        if isinstance(self.writer, MessageWriter) and self.citations is not None:
            self._write_cited(self.citations.feed(text))
        elif isinstance(self.writer, MessageWriter):
            self._message_delta(text)
        elif self.writer is not None:
            self.writer.delta(text)

    def _write_cited(self, chunks) -> None:
        for chunk in chunks:
            base = len(self.writer.text)
            self._message_delta(chunk.text)
            for c in chunk.citations:
                self.writer.annotate(c.url, c.title, base + c.start_index, base + c.end_index)

    def _end_item(self, end: MessageEnd) -> None:
        writer, route = self.writer, self.route
        if isinstance(writer, MessageWriter) and self.citations is not None:
            self._write_cited(self.citations.flush())
        self.writer, self.route, self.citations, self.logprobs = None, None, None, []
        if end.channel == "analysis":
            self.usage["reasoning"] += end.num_tokens
        bad = end.malformed is not None or (route is not None and route.kind == "unknown")
        if not (end.recipient and (end.truncated or bad)):
            # A call cut short or to no tool is never answered: later prompts leave it out.
            self.outcome.new_messages.append(end.to_message())
        if writer is None:
            return
        if bad:
            log.warning(
                "malformed model output in %s: %s",
                self.task.response_id,
                end.malformed or f"unknown recipient {end.recipient!r}",
            )
        if end.truncated or bad:
            writer.done("incomplete")
            return
        if not isinstance(writer, ToolCallItem):
            writer.done()
            return
        self.calls.append(PendingCall(route, end.recipient or "", end.text, writer))
        if not writer.runs_here:  # the client runs it; a built-in is finished once it has run
            writer.done()
            self.outcome.function_calls[writer.item.call_id] = route.client.qualified_name
            if not self.task.parallel_tool_calls:
                self.turn_over = True

    def _close_open_item(self, status: str) -> None:
        for call in self.calls:
            if call.item.runs_here and call.item.item.status not in ("completed", "failed", "incomplete"):
                call.item.done("incomplete")
        self.calls = []
        if self.writer is not None:
            if isinstance(self.writer, MessageWriter) and self.citations is not None:
                self._write_cited(self.citations.flush())
            self.writer.done(status)
            self.writer, self.citations = None, None

    # -- built-in tools ----------------------------------------------------------------------

    async def _run_tool(self, call: PendingCall) -> Message:
        """Run one built-in call, finish its item, and return the tool message for the model."""
        item = call.item
        args = _json_object(call.arguments)
        item.running(args)
        limit = self.task.max_tool_calls
        if limit is not None and self.tool_calls_made >= limit:
            text, ok, details = (
                f"Error: the limit of {limit} tool calls for this response was reached. Answer with what you have.",
                False,
                {},
            )
            outcome = "limit"
        else:
            self.tool_calls_made += 1
            text, ok, details = await self._call(call)
            outcome = "ok" if ok else "error"
        if self.metrics is not None:
            self.metrics.tool_calls.labels(item.metric_label, outcome).inc()
        item.finished(ok, text, args, details, self.task.include)
        return tool_message(call.recipient, text)

    async def _call(self, call: PendingCall) -> tuple[str, bool, dict]:
        """(text for the model, success, details). Tools fail soft: errors become text."""
        try:
            session = await self.sessions.get(call.route.server)
            result = await asyncio.wait_for(session.call(call.recipient, call.arguments), self.task.tool_timeout)
        except asyncio.TimeoutError:
            return f"Error: the tool did not answer within {self.task.tool_timeout:.0f} seconds.", False, {}
        except Exception as e:
            log.warning("tool %s failed: %s", call.recipient, e)
            return f"Error: {type(e).__name__}: {e}", False, {}
        details = getattr(result, "details", None) or {}
        ok = not getattr(result, "is_error", False)
        return fit_tokenization_budget(result.text), ok, details if isinstance(details, dict) else {}

    def _set_usage(self) -> None:
        u = self.usage
        self.events.response.usage = ResponseUsage(
            input_tokens=u["input"],
            input_tokens_details={"cached_tokens": u["cached"], "cache_write_tokens": 0},
            output_tokens=u["output"],
            output_tokens_details={"reasoning_tokens": u["reasoning"]},
            total_tokens=u["input"] + u["output"],
        )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
