"""The pieces under the HTTP layer: Harmony parsing with recovery, stop strings, citations,
error mapping and the response store."""

from __future__ import annotations

import random

import pytest
from openai_harmony import Role

from agent_server.chat.stop_strings import StopStringMatcher
from agent_server.errors import from_validation_error
from agent_server.harmony import (
    MAX_HEADER_TOKENS,
    ContentDelta,
    HarmonyStream,
    MessageEnd,
    MessageStart,
    PreambleTokens,
    PromptConfig,
    continuation_tokens,
    preamble,
    render_prompt,
    tool_message,
)
from agent_server.store import SQLiteResponseStore, StoredResponse
from agent_server.token_bytes import token_bytes
from inference.tokenizer import harmony_encoding
from tests.fake_engine import harmony_tokens
from tools.browser.citation_stream import CitationStreamer


def parse(text_or_tokens):
    tokens = harmony_tokens(text_or_tokens) if isinstance(text_or_tokens, str) else text_or_tokens
    stream = HarmonyStream()
    events = []
    for token in tokens:
        events += stream.feed(token)
    events += stream.finish()
    ends = [e for e in events if isinstance(e, MessageEnd)]
    # Streamed text adds up to each message's text, and every token belongs to one message.
    texts, current = [], None
    for e in events:
        if isinstance(e, MessageStart):
            current = ""
        elif isinstance(e, ContentDelta):
            current += e.text
        elif isinstance(e, MessageEnd):
            texts.append(current)
    assert texts == [e.text for e in ends]
    assert sum(e.num_tokens for e in ends) + stream.dropped_tokens == len(tokens)
    return ends


def test_well_formed_turn():
    ends = parse(
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    assert [(e.channel, e.recipient, e.text, e.malformed) for e in ends] == [
        ("analysis", None, "Think.", None),
        ("commentary", "functions.get_weather", '{"city": "Paris"}', None),
    ]
    assert ends[1].content_type == "<|constrain|>json"


def test_junk_after_a_message_is_kept_as_malformed_text_and_parsing_resumes():
    ends = parse(
        "<|channel|>final<|message|>Hi<|end|>stray words<|start|>assistant<|channel|>final<|message|>Again<|return|>"
    )
    assert [e.text for e in ends] == ["Hi", "stray words", "Again"]
    assert ends[1].malformed and not ends[0].malformed and not ends[2].malformed


def test_broken_header_recovers_its_text():
    ends = parse("<|channel|><|channel|>final<|message|>x<|return|>")
    assert len(ends) == 1 and ends[0].malformed
    assert "final" in ends[0].text and ends[0].text.endswith("x")


def test_a_header_the_turn_ends_in_is_dropped_not_shown_as_markup():
    # The token limit or an abort cut the next message inside its header: no item of markup.
    ends = parse("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final")
    assert [(e.channel, e.text) for e in ends] == [("analysis", "Think.")]
    assert parse("<|channel|>") == [] and parse("<|start|>assistant<|channel|>commentary to=functions.f") == []


def test_malformed_text_never_shows_harmony_markup():
    ends = parse("garbage only<|return|>")  # a turn with no header at all: its text, not the stop token
    assert [(e.text, bool(e.malformed)) for e in ends] == [("garbage only", True)]
    ends = parse("<|channel|>final<|end|>")  # a header ended without content
    assert len(ends) == 1 and ends[0].malformed and "<|" not in ends[0].text


def test_text_without_header_is_streamed_once_the_header_is_too_long():
    words = harmony_tokens(" word" * (MAX_HEADER_TOKENS + 10))
    stream = HarmonyStream()
    deltas_before_end = 0
    for token in words:
        deltas_before_end += sum(isinstance(e, ContentDelta) for e in stream.feed(token))
    assert deltas_before_end > 0  # not buffered to the end
    ends = [e for e in stream.finish() if isinstance(e, MessageEnd)]
    assert ends[0].malformed and ends[0].text == " word" * (MAX_HEADER_TOKENS + 10)


def test_random_tokens_never_raise():
    rng = random.Random(0)
    for _ in range(20):
        tokens = [rng.randrange(0, 201088) for _ in range(rng.randrange(1, 80))]
        parse(tokens)


def partial_character_token() -> int:
    """A token whose bytes end inside a UTF-8 character (a space, then a lead byte)."""
    for token in range(1000, 200_000):
        raw = token_bytes(token)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data" and raw[:1] == b" ":
                return token
    raise AssertionError("no such token")


@pytest.mark.parametrize("end", ["<|call|>", "<|end|>", ""])
def test_a_message_ending_inside_a_character_streams_what_it_ends_with(end):
    """The deltas hold back a character split over tokens; when the message ends inside it, its
    replacement character is streamed too, so the code a python cell runs is the code streamed
    (`parse` checks deltas against each message's text)."""
    tokens = harmony_tokens("<|channel|>commentary to=python<|message|>print(1)")
    ends = parse(tokens + [partial_character_token()] + harmony_tokens(end))
    assert ends[0].text == "print(1) \ufffd" and ends[0].truncated == (end == "")


def test_truncated_message_is_marked():
    ends = parse("<|channel|>final<|message|>Hello wor")
    assert ends[0].truncated and ends[0].text == "Hello wor" and not ends[0].malformed


def test_continuation_tokens_match_harmony_rendering():
    """Appending a tool message to a turn gives exactly what Harmony renders for the whole
    conversation, so the engine's parked sequence is a prefix of the next prompt."""
    from openai_harmony import Message

    config = PromptConfig(reasoning_effort="low")
    user = Message.from_role_and_content(Role.USER, "Search.")
    prompt = render_prompt(preamble(config) + [user])
    call_text = '{"query":"x"}'
    call = (
        Message.from_role_and_content(Role.ASSISTANT, call_text)
        .with_channel("analysis")
        .with_recipient("browser.search")
        .with_content_type("<|constrain|>json")
    )
    generated = harmony_encoding().render(call)[2:]  # the model's tokens after "<|start|>assistant"
    answer = tool_message("browser.search", "results")
    whole = render_prompt(preamble(config) + [user, call, answer])
    assert prompt + generated + continuation_tokens([answer]) == whole


def test_preamble_tokens_are_reused_only_for_the_same_preamble():
    """render_prompt's cached system and developer messages give what Harmony renders for the whole
    conversation, whatever follows them (function tools in the developer message change the system
    message's text), and no two different preambles share tokens."""
    from openai_harmony import Conversation, Message, RenderConversationConfig, ToolDescription, ToolNamespaceConfig

    def uncached(messages):
        return harmony_encoding().render_conversation_for_completion(
            Conversation.from_messages(messages), Role.ASSISTANT, RenderConversationConfig(auto_drop_analysis=True)
        )

    user = Message.from_role_and_content(Role.USER, "What is 2 + 2?")
    thought = Message.from_role_and_content(Role.ASSISTANT, "Easy.").with_channel("analysis")
    final = Message.from_role_and_content(Role.ASSISTANT, "4").with_channel("final")
    call = (
        Message.from_role_and_content(Role.ASSISTANT, '{"code":"1"}').with_channel("analysis").with_recipient("python")
    )
    weather = ToolDescription.new(
        "weather", "Weather now", parameters={"type": "object", "properties": {"city": {"type": "string"}}}
    )
    other = ToolNamespaceConfig(name="functions2", description="", tools=[weather])
    configs = [
        PromptConfig(),
        PromptConfig(reasoning_effort="high"),
        PromptConfig(conversation_start_date="2026-01-02"),
        PromptConfig(conversation_start_date="2026-01-03"),
        PromptConfig(tool_namespaces=[ToolNamespaceConfig.browser(), ToolNamespaceConfig.python()]),
        PromptConfig(tool_namespaces=[ToolNamespaceConfig.browser()]),
        PromptConfig(tool_namespaces=[other]),
        PromptConfig(instructions="Be brief.", function_tools=[weather]),
    ]
    rests = [[user], [user, thought, final, user], [user, call, tool_message("python", "1")]]
    heads = set()
    for _ in range(2):  # the second pass reads the cache
        for config in configs:
            for rest in rests:
                messages = preamble(config) + rest
                assert render_prompt(messages) == uncached(messages)
            heads.add(tuple(render_prompt(preamble(config) + [user])))
        assert render_prompt([user]) == uncached([user])  # no preamble at all
        late = [*preamble(PromptConfig()), user, *preamble(configs[-1])[1:]]  # function tools after the preamble
        assert render_prompt(late) == uncached(late)
    assert len(heads) == len(configs)
    cache = PreambleTokens(size=2)
    for config in configs[:3]:
        tokens = cache.get(preamble(config))
        tokens.append(-1)  # callers own what they get
    assert len(cache._tokens) == 2 and -1 not in cache.get(preamble(configs[2]))


def test_user_messages_rendered_by_hand_match_harmony():
    """render_prompt writes plain user messages itself (openai-harmony's render costs 0.1 ms a call
    besides tokenising): the tokens must be Harmony's, whatever the text holds, special-token
    strings included; user messages with anything more go through openai-harmony."""
    from openai_harmony import Author, Conversation, Message, RenderConversationConfig

    def uncached(messages):
        return harmony_encoding().render_conversation_for_completion(
            Conversation.from_messages(messages), Role.ASSISTANT, RenderConversationConfig(auto_drop_analysis=True)
        )

    rng = random.Random(5)
    pieces = [
        "",
        " ",
        "\n",
        "\n\n",
        "  x",
        "hello",
        " world",
        "<|start|>",
        "<|end|>",
        "<|message|>assistant",
        "<|endoftext|>",
        "<|reserved_200100|>",
        "é",
        "日本語",
        "🙂",
        "\t",
        "123456",
        "user",
        "'s",
        "\r\n",
    ]
    texts = [
        "",
        "hi",
        "<|start|>user<|message|>x<|end|>",
        "a" * 3000,
        harmony_encoding().decode([rng.randrange(1000, 199000) for _ in range(256)]),
    ]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12))) for _ in range(200)]
    config = PromptConfig(reasoning_effort="low")
    for text in texts:
        user = Message.from_role_and_content(Role.USER, text)
        for messages in ([user], preamble(config) + [user], preamble(config) + [user, user]):
            assert render_prompt(messages) == uncached(messages), repr(text)
    named = Message.from_author_and_content(Author.new(Role.USER, "bob"), "hi")
    for other in (named, Message.from_role_and_content(Role.USER, "hi").with_channel("final")):
        messages = preamble(config) + [Message.from_role_and_content(Role.USER, "x"), other]
        assert render_prompt(messages) == uncached(messages)


def test_stop_strings_hold_back_only_possible_prefixes():
    m = StopStringMatcher(["END", "stop here"])
    out = m.feed("Hello E") + m.feed("N") + m.feed("x and s") + m.feed("top") + m.feed(" hereafter")
    assert m.stopped and out == "Hello ENx and "
    m = StopStringMatcher(["END"])
    assert m.feed("abc E") == "abc " and m.flush() == "E" and not m.stopped


def _released_by_definition(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    """What a stop-string matcher must release: all text before the first stop string found in a
    chunk's view (held text + chunk), holding back each time the longest suffix that begins one."""
    held, out = "", ""
    for chunk in chunks:
        buffer = held + chunk
        hits = [i for i in (buffer.find(s) for s in stops) if i >= 0]
        if hits:
            return out + buffer[: min(hits)], True
        keep = max((n for s in stops for n in range(1, len(s)) if buffer.endswith(s[:n])), default=0)
        held, out = buffer[len(buffer) - keep :], out + buffer[: len(buffer) - keep]
    return out + held, False


def test_stop_strings_match_their_definition():
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        chunks = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 12))]
        m = StopStringMatcher(stops)
        out = "".join(m.feed(c) for c in chunks)
        out += m.flush()
        assert (out, m.stopped) == _released_by_definition(stops, chunks), (stops, chunks)


@pytest.mark.timeout(60)
def test_a_long_stop_string_costs_linear_time():
    # Output that keeps matching a 40,000-character stop string: quadratic work a token would take hours.
    stop = "ab" * 20_000
    m = StopStringMatcher(["x" + stop, stop])  # the first never matches: every prefix length is tried
    out = "".join(m.feed("ab") for _ in range(19_999))
    assert out == "" and not m.stopped and len(m.held) == 39_998
    assert m.feed("ac") == "ab" * 19_999 + "ac" and m.held == ""
    assert m.feed("ab" * 20_000 + "!") == "" and m.stopped


def test_citations_are_resolved_across_deltas():
    def resolve(mark):
        return "[src]", [{"url": "https://a.example", "title": "A", "start_index": 0, "end_index": 5}]

    streamer = CitationStreamer(resolve)
    chunks = []
    for piece in ["It is 【", "3†L1", "-L2】 so.", " 【not a cite"]:
        chunks += streamer.feed(piece)
    chunks += streamer.flush()
    text, spans = "", []
    for chunk in chunks:
        spans += [(len(text) + c.start_index, len(text) + c.end_index, c.url) for c in chunk.citations]
        text += chunk.text
    assert text == "It is [src] so. 【not a cite"
    assert [(text[a:b], url) for a, b, url in spans] == [("[src]", "https://a.example")]


def test_citations_merge_repeats_and_drop_an_unfinished_mark_at_the_end():
    def resolve(mark):
        url = "https://a.example" if mark.startswith("【3") else "https://b.example"
        return "[src]", [{"url": url, "title": "A", "start_index": 0, "end_index": 5}]

    def run(pieces):
        streamer = CitationStreamer(resolve)
        chunks = [c for piece in pieces for c in streamer.feed(piece)] + streamer.flush()
        return "".join(c.text for c in chunks), [c.citations[0].url for c in chunks if c.citations]

    # Same URL twice in a row (only whitespace between): one link, the space before the repeat
    # gone with it. Text or another URL between: kept.
    assert run(["A 【3†L1】 【3", "†L4】. B 【3†L2】"]) == ("A [src]. B [src]", ["https://a.example"] * 2)
    assert run(["A 【3†L1】【4†L2】【3†L3】"]) == (
        "A [src][src][src]",
        ["https://a.example", "https://b.example", "https://a.example"],
    )
    # The answer ends inside a mark: removed; a 【 that is no citation stays.
    assert run(["Done 【3†L1"]) == ("Done ", [])
    assert run(["Done 【"]) == ("Done ", [])
    assert run(["Done 【not a cite"]) == ("Done 【not a cite", [])


def test_streamed_citations_match_the_browsers_spacing():
    # The browser's resolver puts a space before a link unless the text before it ends in one,
    # and an unresolvable mark takes the spaces before it; streamed one mark at a time it cannot
    # see the text around a mark, so the streamer holds spaces back until it can tell.
    from tests.tools.browser.test_session import pages_for_citations
    from tools.browser.citations import resolve_citations

    pages = pages_for_citations()
    for answer in [
        "Fact 【1†L2】 and more",
        "Fact【1†L2】 and more",
        "A 【0†L4】 B\n【0†L6】【0†L7】",
        # unresolvable marks take the spaces before them when punctuation, a space or the end follows
        "fact 【9†L1】.",
        "fact 【9†L1】 more",
        "fact  【9†L1】more",
        "end 【9†L1】",
        "end 【9†L1】 ",
        "A 【0†L4】 【0†L4】 B",
        "two  spaces kept",
        "trailing spaces kept  ",
        "x 【9†L1】\ny",
    ]:
        streamer = CitationStreamer(lambda mark: resolve_citations(mark, pages))
        chunks = [c for char in answer for c in streamer.feed(char)] + streamer.flush()
        text, spans = "", []
        for chunk in chunks:
            spans += [(len(text) + c.start_index, len(text) + c.end_index) for c in chunk.citations]
            text += chunk.text
        expected, annotations = resolve_citations(answer, pages)
        assert text == expected
        assert spans == [(a["start_index"], a["end_index"]) for a in annotations]


def test_validation_errors_name_the_parameter():
    from pydantic import ValidationError

    from schemas.responses import ResponseCreateRequest

    cases = {
        "temperature": {"model": "m", "input": "x", "temperature": 7},
        "foo": {"model": "m", "input": "x", "foo": 1},
        "model": {"input": "x"},
        "input[1].content[0]": {
            "model": "m",
            "input": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_image"}]}],
        },
        "tools[0].name": {"model": "m", "input": "x", "tools": [{"type": "function", "name": "bad name!"}]},
        "reasoning.effort": {"model": "m", "input": "x", "reasoning": {"effort": "extreme"}},
    }
    for param, body in cases.items():
        with pytest.raises(ValidationError) as info:
            ResponseCreateRequest.model_validate(body)
        error = from_validation_error(info.value, body)
        assert error.status == 400 and error.param == param, (param, error.body())


def test_sqlite_store_round_trip_and_interrupted_responses(tmp_path):
    import asyncio

    async def scenario():
        store = SQLiteResponseStore(tmp_path / "r.db")
        done = StoredResponse(
            "resp_1",
            {"id": "resp_1", "status": "completed"},
            [{"id": "msg_1"}],
            conversation=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            function_calls={"call_1": "f"},
        )
        running = StoredResponse("resp_2", {"id": "resp_2", "status": "in_progress"}, [])
        await store.put(done)
        await store.put(running)
        await store.close()
        store = SQLiteResponseStore(tmp_path / "r.db")  # a restart
        again = await store.get("resp_1")
        assert again == done
        assert (await store.get("resp_2")).status == "failed"
        assert await store.delete("resp_1") and await store.get("resp_1") is None
        assert not await store.delete("resp_1")
        await store.close()

    asyncio.run(scenario())
