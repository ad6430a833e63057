"""Engine faults: an exception inside a step fails only the requests in that step, and the
engine keeps serving. A fault is injected into the real engine on the tiny model by making
the model runner raise for one chosen step.

On the synchronous core the outcome is exact: the step's sequences end with finish_reason
"error" and give their pages back, a request waiting outside the step generates exactly what
it generates with no fault at all. Through HTTP: a Responses stream in the failed step ends
with `response.failed` (stored as failed), a chat completion in it gets a clean server error,
while the requests outside the step, and every request after it, succeed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from inference.config import EngineConfig
from inference.engine.async_engine import AsyncEngine
from inference.engine.core import LLMEngine
from inference.model.gpt_oss import GptOssModel
from inference.request import GenerationRequest, SamplingParams
from tests.conftest import MODEL, LiveServer, make_app
from tests.engine_runs import drain


class InjectedFault(RuntimeError):
    pass


def greedy(rid: str, prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    return GptOssModel.from_pretrained(tiny_checkpoint, device="cpu")


def test_a_faulty_step_fails_only_its_sequences(tiny_model, monkeypatch):
    prompts = {"a": list(range(10, 40)), "b": list(range(50, 62)), "c": list(range(70, 95))}
    reference = LLMEngine(tiny_model, EngineConfig(page_size=4, num_pages=128, max_num_seqs=2, enforce_eager=True))
    for rid in ("a", "c"):
        reference.add_request(greedy(rid, prompts[rid], 4))
    expected = {rid: [t for d in ds for t in d.token_ids] for rid, ds in drain(reference).items()}

    engine = LLMEngine(tiny_model, EngineConfig(page_size=4, num_pages=128, max_num_seqs=2, enforce_eager=True))
    for rid, p in prompts.items():
        engine.add_request(greedy(rid, p, 4))
    first = engine.step()  # a and b prefill (max_num_seqs=2); c waits
    assert {d.request_id for d in first} == {"a", "b"} and all(d.finish_reason is None for d in first)

    real_run, in_step = engine.runner.run, []

    def faulty(batch):
        in_step.extend(seq.request_id for seq in batch.seqs)
        raise InjectedFault("injected for the test")

    monkeypatch.setattr(engine.runner, "run", faulty)
    failed = engine.step()
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert sorted(in_step) == ["a", "b"]
    assert sorted(d.request_id for d in failed) == ["a", "b"]
    assert all(d.finish_reason == "error" and "InjectedFault" in d.error and not d.token_ids for d in failed)
    assert engine.scheduler.find("a") is None and engine.scheduler.find("b") is None

    # c was not in that step: it generates exactly what it does when nothing fails.
    rest = drain(engine)
    assert set(rest) == {"c"}
    assert [t for d in rest["c"] for t in d.token_ids] == expected["c"]
    assert rest["c"][-1].finish_reason == "length"
    # And the engine keeps serving: a new request gets the same tokens a's prompt always gets.
    engine.add_request(greedy("a2", prompts["a"], 4))
    again = drain(engine)
    assert [t for d in again["a2"] for t in d.token_ids] == expected["a"]
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.pages_used == 0  # the failed ones leaked no pages


# --- through HTTP -------------------------------------------------------------------------


def sse_events(lines) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    return events


@pytest.fixture
def faulty_server(tmp_path, tiny_checkpoint, monkeypatch):
    """The real engine (at most 2 sequences per step) whose runner can be held and made to fail."""
    engine = AsyncEngine.from_pretrained(
        str(tiny_checkpoint), device="cpu", max_model_len=1024, num_pages=256, enforce_eager=True, max_num_seqs=2
    )
    control = type("Control", (), {})()
    control.entered, control.release = threading.Event(), threading.Event()
    control.failed_ids: list[str] = []
    control.hold_first = True
    real_run = engine.engine.runner.run

    def run(batch):
        ids = [seq.request_id for seq in batch.seqs]
        if control.hold_first and not control.entered.is_set():
            control.entered.set()  # hold the engine inside its first step while requests queue up
            control.release.wait(60)
        elif (
            not control.failed_ids
            and any(i.startswith("resp_") for i in ids)
            and any(i.startswith("chatcmpl-") for i in ids)
        ):
            control.failed_ids = ids  # the first step holding a response and a chat completion
            raise InjectedFault("injected for the test")
        return real_run(batch)

    monkeypatch.setattr(engine.engine.runner, "run", run)
    server = LiveServer(make_app(lambda: engine, tmp_path / "r.db"), kind="tiny").start()
    server.control = control
    yield server
    control.release.set()
    server.stop()


@pytest.mark.slow
def test_a_fault_mid_batch_fails_only_those_requests_over_http(faulty_server, caplog):
    server, control = faulty_server, faulty_server.control
    url, engine = server.url, server.engine
    results: dict[str, object] = {}

    def responses_stream():
        body = {"model": MODEL, "input": "first", "stream": True, "max_output_tokens": 16}
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=120) as r:
            results["A"] = (r.status_code, sse_events(r.iter_lines()))

    def chat_plain():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "second"}], "max_tokens": 16}
        results["B"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

    def chat_stream():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "third"}], "max_tokens": 16, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            results["C"] = (r.status_code, list(r.iter_lines()))

    def responses_plain():
        body = {"model": MODEL, "input": "fourth", "max_output_tokens": 16}
        results["D"] = httpx.post(f"{url}/v1/responses", json=body, timeout=120)

    threads = {
        name: threading.Thread(target=fn)
        for name, fn in (("A", responses_stream), ("B", chat_plain), ("C", chat_stream), ("D", responses_plain))
    }
    threads["A"].start()
    assert control.entered.wait(60)  # A's prefill is the step being held
    for i, name in enumerate("BCD", start=1):
        threads[name].start()
        deadline = time.monotonic() + 60
        while len(engine._inbox) < i:  # queued behind the held step, in this order
            assert time.monotonic() < deadline
            time.sleep(0.005)
    control.release.set()
    for t in threads.values():
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads.values())

    failed = control.failed_ids
    assert failed and len(failed) <= 2  # the fault hit one step of at most two sequences
    status_a, events_a = results["A"]
    response_id = events_a[0]["response"]["id"]
    chat_b = results["B"]
    status_c, lines_c = results["C"]
    chunks_c = sse_events(lines_c)
    chat_c_id = chunks_c[0]["id"]  # the stream's first chunk (the role) comes before any generation
    failed_chats = [i for i in failed if i.startswith("chatcmpl-")]
    in_step = {
        "A": any(i.startswith(f"{response_id}/") for i in failed),
        "B": any(not i.startswith(f"{chat_c_id}/") for i in failed_chats),
        "C": any(i.startswith(f"{chat_c_id}/") for i in failed_chats),
    }
    assert in_step["A"], failed  # A was running when the chat completion joined its step
    assert in_step["B"] or in_step["C"]

    # A (in the step): the stream ends with response.failed, and the stored response says so.
    assert status_a == 200
    assert events_a[-1]["type"] == "response.failed"
    error = events_a[-1]["response"]["error"]
    # The engine's reason is logged; the client gets the request id to quote, not internals.
    assert error["code"] == "server_error" and "request id" in error["message"]
    assert "InjectedFault" not in json.dumps(events_a) and "injected for the test" not in json.dumps(events_a)
    assert "InjectedFault" in caplog.text
    assert "Traceback" not in json.dumps(events_a)
    stored = httpx.get(f"{url}/v1/responses/{response_id}").json()
    assert stored["status"] == "failed" and stored["error"]["code"] == "server_error"

    # The chat completion in the step gets a clean error; the one outside it (if any) completes.
    if in_step["B"]:
        assert chat_b.status_code == 500
        body = chat_b.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "server_error" and "Traceback" not in chat_b.text
        assert "InjectedFault" not in chat_b.text and "request id" in body["error"]["message"]
    else:
        assert chat_b.status_code == 200 and chat_b.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert status_c == 200 and "data: [DONE]" in lines_c
    if in_step["C"]:
        errors = [c for c in chunks_c if "error" in c]
        assert errors and errors[0]["error"]["type"] == "server_error"
    else:
        assert not any("error" in c for c in chunks_c)
        assert chunks_c[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    # D queued outside the failed step: it succeeds.
    assert results["D"].status_code == 200 and results["D"].json()["status"] in ("completed", "incomplete")
    assert not any(i.startswith(results["D"].json()["id"]) for i in failed)

    # The engine keeps serving, and the failed requests left nothing behind.
    later = httpx.post(
        f"{url}/v1/responses", json={"model": MODEL, "input": "after", "max_output_tokens": 8}, timeout=120
    )
    assert later.status_code == 200 and later.json()["status"] in ("completed", "incomplete")
    later = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "after"}]},
    )
    assert later.status_code == 200
    deadline = time.monotonic() + 10
    while engine.stats().running or engine.stats().pages_used:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
