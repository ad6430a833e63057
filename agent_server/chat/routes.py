"""`POST /v1/chat/completions`: one Harmony turn per choice, no server-side tools.

Each choice is an engine request whose tokens go through `HarmonyStream`: the analysis
channel becomes `reasoning` (and `reasoning_content`, its older name), final (and commentary
preambles) `content`, commentary calls to `functions.*` become `tool_calls`. Streaming sends OpenAI chunks (`data:` lines, then
`[DONE]`); a client that disconnects stops every choice's generation.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from openai.types.chat import ChatCompletion
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent_server.chat.prompt import chat_messages, chat_turn_rules
from agent_server.chat.stop_strings import StopStringMatcher
from agent_server.errors import APIError, engine_unavailable, internal_error
from agent_server.harmony import ContentDelta, HarmonyStream, MessageEnd, MessageStart, recipient_kind, render_prompt
from agent_server.large_prompts import check_fits, text_chars
from agent_server.request_parsing import read_request
from agent_server.sse import compact_json, data_only, sse_response
from agent_server.state import ServerState
from agent_server.token_bytes import is_special, logprob_entry
from inference.request import DeltaStream, GenerationRequest, Grammar, SamplingParams, TokenLogprob
from inference.tokenizer import CALL, RETURN
from schemas.chat import ChatCompletionRequest

log = logging.getLogger(__name__)

# Parameters of OpenAI's Chat Completions API this server does not take, and why.
UNSUPPORTED = {
    "audio": "gpt-oss reads and writes text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "chat completions run no server-side tools; use /v1/responses with a web_search tool",
    "functions": "it is deprecated; use 'tools'",
    "function_call": "it is deprecated; use 'tool_choice'",
    "moderation": "this server runs no moderation model",
}

# --- one choice ---------------------------------------------------------------------------


@dataclass
class ChoicePiece:
    """What one choice added since the last piece (a streaming delta, in effect)."""

    index: int
    reasoning: str = ""
    content: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI delta tool_calls entries
    finish_reason: str | None = None

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.logprobs or self.tool_calls or self.finish_reason)


@dataclass
class ChoiceUsage:
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    reasoning: int = 0


def _logprob_entry(lp: TokenLogprob, top: int) -> dict[str, Any]:
    return logprob_entry(lp.token_id, lp.logprob, lp.top, top)


class ChoiceStream:
    """Generates one choice and yields its pieces as Harmony messages are parsed."""

    def __init__(
        self, state: ServerState, index: int, request: GenerationRequest, req: ChatCompletionRequest, started: float
    ):
        self.state = state
        self.index = index
        self.request = request
        self.want_logprobs = req.logprobs
        self.top_logprobs = req.top_logprobs or 0
        self.stops = StopStringMatcher(req.stop_strings)
        self.started = started
        self.usage = ChoiceUsage()
        self.kind: str | None = None  # "reasoning" | "content" | "tool" | None between messages
        self.pending_logprobs: list[dict[str, Any]] = []  # tokens of the current message not yet emitted
        # Content tokens' entries wait for their text: each is released once the stop strings
        # have let out all of it (offsets in the content text fed to them, and let out so far).
        self.held_logprobs: list[tuple[int, dict[str, Any]]] = []
        self.content_fed = 0
        self.content_out = 0
        self.tool_calls = 0
        # parallel_tool_calls=false: the choice ends with its first complete tool call.
        self.one_call = req.parallel_tool_calls is False
        self.calls_done = False
        self.finish: str | None = None
        self.generation: DeltaStream | None = None

    def start(self) -> None:
        """Hand the request to the engine now: it prefills while the response is set up."""
        try:
            self.generation = self.state.engine.generate(self.request)
        except ValueError as e:  # the engine refused the request (limits it checks itself)
            raise APIError(f"Invalid request: {e}.") from None
        except RuntimeError as e:  # the engine is gone (its process exited) or shut down
            raise engine_unavailable(str(e)) from None
        self.generation.open()

    async def pieces(self) -> AsyncIterator[ChoicePiece]:
        """The choice's pieces, once `start` has handed its request to the engine."""
        engine = self.state.engine
        stream = HarmonyStream()
        deltas = self.state.metrics.observe_generation(self.generation, self.started)
        finish, stop_token = None, None
        try:
            async for delta in deltas:
                if not self.usage.prompt:
                    self.usage.prompt, self.usage.cached = delta.num_prompt_tokens, delta.num_cached_tokens
                piece = ChoicePiece(self.index)
                for i, token in enumerate(delta.token_ids):
                    self.usage.completion += 1
                    if self.want_logprobs and delta.logprobs and not is_special(token):  # (markup: no text)
                        self.pending_logprobs.append(_logprob_entry(delta.logprobs[i], self.top_logprobs))
                    self._apply(stream.feed(token), piece)
                    if self.stops.stopped or self.calls_done:
                        break
                if delta.finish_reason is not None:
                    finish, stop_token = delta.finish_reason, delta.stop_token_id
                    if delta.finish_reason == "error":
                        log.error("chat completion %s: generation failed: %s", self.request.request_id, delta.error)
                        raise internal_error()
                if self.stops.stopped:
                    engine.abort(self.request.request_id)
                    finish = "stop_string"
                elif self.calls_done and finish is None:
                    engine.abort(self.request.request_id)
                    finish = "tool_call"
                if not piece.empty():
                    yield piece
                if finish is not None:
                    break
        except BaseException:
            engine.abort(self.request.request_id)
            raise
        finally:
            await deltas.aclose()
        last = ChoicePiece(self.index)
        if finish != "stop_string":
            self._apply(stream.finish(), last)
            self._emit_content(self.stops.flush(), last)
        if finish == "length":
            last.finish_reason = "length"
        elif self.tool_calls and (finish != "stop" or stop_token in (CALL, None)):
            last.finish_reason = "tool_calls"
        else:
            last.finish_reason = "stop"
        self.finish = last.finish_reason
        yield last

    def _apply(self, events, piece: ChoicePiece) -> None:
        for event in events:
            if isinstance(event, MessageStart):
                namespace, name = recipient_kind(event.recipient)
                if event.malformed:
                    self.kind = "content"  # keep the header tokens: they are part of the text
                    continue
                self.pending_logprobs = []
                if namespace == "functions" and name:
                    self.kind = "tool"
                    piece.tool_calls.append(
                        {
                            "index": self.tool_calls,
                            "id": f"call_{secrets.token_hex(12)}",
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    )
                    self.tool_calls += 1
                elif event.channel == "analysis" and not event.recipient:
                    self.kind = "reasoning"
                else:
                    self.kind = "content"
            elif isinstance(event, ContentDelta):
                if self.kind == "reasoning":
                    piece.reasoning += event.text
                elif self.kind == "tool":
                    piece.tool_calls.append({"index": self.tool_calls - 1, "function": {"arguments": event.text}})
                elif self.kind == "content" and not self.stops.stopped:
                    self.content_fed += len(event.text)
                    self.held_logprobs += [(self.content_fed, entry) for entry in self.pending_logprobs]
                    self.pending_logprobs = []
                    self._emit_content(self.stops.feed(event.text), piece)
            elif isinstance(event, MessageEnd):
                if event.channel == "analysis":
                    self.usage.reasoning += event.num_tokens
                self.calls_done = self.calls_done or (self.kind == "tool" and self.one_call)
                self.kind, self.pending_logprobs = None, []

    def _emit_content(self, text: str, piece: ChoicePiece) -> None:
        """Content the stop strings let out, with the entries of the tokens it completes (a token
        a stop string cuts into keeps its entry back, as the tokens after it do)."""
        piece.content += text
        self.content_out += len(text)
        done = 0
        while done < len(self.held_logprobs) and self.held_logprobs[done][0] <= self.content_out:
            done += 1
        piece.logprobs += [entry for _, entry in self.held_logprobs[:done]]
        del self.held_logprobs[:done]


# --- the endpoint -------------------------------------------------------------------------


def _sampling(
    req: ChatCompletionRequest, index: int, max_tokens: int, vocab_size: int, grammar: Grammar | None = None
) -> SamplingParams:
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=None if req.seed is None else req.seed + index,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        max_tokens=max_tokens,
        stop_token_ids=[] if req.ignore_eos else [RETURN, CALL],
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        grammar=grammar,
    )
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise APIError(f"Invalid value for 'logit_bias': {e}.", param="logit_bias") from None
    return params


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    config = state.config
    req = await read_request(
        request,
        ChatCompletionRequest,
        config.max_request_bytes,
        unsupported=UNSUPPORTED,
        max_items={"messages": config.max_input_items, "tools": config.max_tools},
    )
    engine = state.engine
    if not state.config.serves(req.model):
        raise APIError(
            f"The model '{req.model}' does not exist; this server serves '{state.config.model_name}'.",
            status=404,
            param="model",
            code="model_not_found",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs=true.", param="top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise APIError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )
    if req.parallel_tool_calls is not None and not req.tools:
        raise APIError(
            "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when 'tools' "
            "are specified.",
            param="parallel_tool_calls",
        )
    messages = chat_messages(req)
    check_fits(messages, engine.max_model_len, "messages", "messages")
    prompt = await state.renderer.run(render_prompt, messages, chars=text_chars(messages))
    room = engine.max_model_len - len(prompt)
    if room <= 0:
        raise APIError(
            f"The messages are {len(prompt)} tokens; this model's context is {engine.max_model_len} tokens.",
            param="messages",
            code="context_length_exceeded",
        )
    if req.token_limit is not None and req.token_limit > room:
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise APIError(
            f"'{param}' is too large: the messages are {len(prompt)} tokens and this model's context "
            f"is {engine.max_model_len}, so at most {room} tokens fit; got {req.token_limit}.",
            param=param,
            code="context_length_exceeded",
        )
    max_tokens = config.output_limit(req.token_limit, room) or room
    rules = chat_turn_rules(req, config.harmony_grammar)
    grammar = rules.grammar(forced=True, budget=max_tokens) if rules is not None else None
    completion_id = f"chatcmpl-{secrets.token_hex(12)}"
    choices = [
        ChoiceStream(
            state,
            i,
            GenerationRequest(
                f"{completion_id}/{i}", prompt, _sampling(req, i, max_tokens, engine.vocab_size, grammar)
            ),
            req,
            started,
        )
        for i in range(req.n)
    ]
    header = {"id": completion_id, "created": int(time.time()), "model": req.model}
    try:
        for choice in choices:
            choice.start()
    except BaseException:
        for choice in choices:
            if choice.generation is not None:
                await choice.generation.aclose()
        raise
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(state, choices, header, include_usage)
    return await _complete(request, choices, header)


async def _complete(request: Request, choices: list[ChoiceStream], header: dict[str, Any]) -> Response:
    async def run(choice: ChoiceStream) -> dict[str, Any]:
        reasoning, content, logprobs, calls = "", "", [], []
        async for piece in choice.pieces():
            reasoning += piece.reasoning
            content += piece.content
            logprobs += piece.logprobs
            for call in piece.tool_calls:
                if "id" in call:
                    calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
                else:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:  # `reasoning`, as OpenAI's gpt-oss guide names it; `reasoning_content` for older clients
            message["reasoning"] = message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            "index": choice.index,
            "message": message,
            "finish_reason": choice.finish,
            "logprobs": {"content": logprobs} if choice.want_logprobs else None,
        }

    runs = [asyncio.ensure_future(run(c)) for c in choices]
    work = asyncio.gather(*runs)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():  # the client left: stop every choice
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=499)
    if work.exception() is not None:  # one choice failed: the whole completion fails, stop the rest
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
    results = work.result()
    body = ChatCompletion.model_validate(
        {
            **header,
            "object": "chat.completion",
            "choices": results,
            "usage": _usage(choices),
        }
    )
    return JSONResponse(body.model_dump(mode="json", exclude_unset=True))


def _usage(choices: list[ChoiceStream]) -> dict[str, Any]:
    prompt = choices[0].usage.prompt
    completion = sum(c.usage.completion for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": choices[0].usage.cached},
        "completion_tokens_details": {"reasoning_tokens": sum(c.usage.reasoning for c in choices)},
    }


def _stream(state: ServerState, choices: list[ChoiceStream], header: dict[str, Any], include_usage: bool):
    tasks: list[asyncio.Task] = []

    async def guarded(choice: ChoiceStream) -> AsyncIterator[ChoicePiece | APIError]:
        """The choice's pieces, a failure as the error to stream in their place."""
        try:
            async for piece in choice.pieces():
                yield piece
        except APIError as e:
            yield e
        except Exception:
            log.exception("chat completion %s failed", header["id"])
            yield APIError("The server had an error while generating.", status=500, code="server_error")

    async def merged() -> AsyncIterator[ChoicePiece | APIError]:
        if len(choices) == 1:  # read in place: no task and queue between engine and client
            async for item in guarded(choices[0]):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def produce(choice: ChoiceStream) -> None:
            try:
                async for item in guarded(choice):
                    await queue.put(item)
            finally:
                await queue.put(None)

        tasks.extend(asyncio.create_task(produce(c)) for c in choices)
        running = len(choices)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item

    def chunk(choice: dict[str, Any], usage: dict[str, Any] | None = None) -> str:
        """A `ChatCompletionChunk` as JSON. Built as a dict of the SDK type's shape, not through
        the type: validating and serialising every token's chunk with pydantic cost as much as
        the rest of its path. The tests validate every chunk against the SDK type."""
        body = {**header, "object": "chat.completion.chunk", "choices": [choice] if choice else []}
        if include_usage:
            body["usage"] = usage
        return compact_json(body)

    async def events():
        for choice in choices:
            yield data_only(
                chunk(
                    {
                        "index": choice.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            )
        async for piece in merged():
            if isinstance(piece, APIError):
                yield data_only(piece.body())
                continue
            delta: dict[str, Any] = {}
            if piece.reasoning:
                delta["reasoning"] = delta["reasoning_content"] = piece.reasoning
            if piece.content:
                delta["content"] = piece.content
            if piece.tool_calls:
                delta["tool_calls"] = piece.tool_calls
            logprobs = {"content": piece.logprobs} if piece.logprobs else None
            if delta or logprobs:
                yield data_only(
                    chunk({"index": piece.index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
                )
            if piece.finish_reason:
                yield data_only(
                    chunk({"index": piece.index, "delta": {}, "logprobs": None, "finish_reason": piece.finish_reason})
                )
        if include_usage:
            yield data_only(chunk({}, _usage(choices)))
        yield data_only("[DONE]")

    def stop() -> None:
        for task in tasks:
            task.cancel()  # each choice aborts its engine request (one choice: closing `events` does)

    return sse_response(events(), ping_seconds=state.config.sse_ping_seconds, on_close=stop)


routes = [Route("/v1/chat/completions", create_chat_completion, methods=["POST"])]
