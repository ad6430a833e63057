"""`oss-agent bench serve` / `bench engine`: workloads, statistics, stream checks, and runs
against a live server on the real engine (tiny random model, CPU, loopback) whose numbers are
checked against the server's own Prometheus metrics."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys

import httpx
import pytest

from agent_server.bench.driver import arrival_gaps, drive
from agent_server.bench.report import RequestResult, json_safe, percentile, summarize
from agent_server.bench.serve import Load, ServeTarget, StreamCheck, drive_in_processes
from agent_server.bench.server_metrics import parse_metrics
from agent_server.bench.workload import BenchRequest, dataset_requests, random_prompt, random_requests
from agent_server.cli.main import main
from inference.tokenizer import RETURN, encode_text
from tests.conftest import MODEL, LiveServer, build_tiny_engine, make_app


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory, tiny_checkpoint):
    """A server of its own: its metrics count only this module's traffic."""
    engine = build_tiny_engine(tiny_checkpoint)
    # No turn grammar: the ignore_eos test needs a model free to end its turn at its first token.
    app = make_app(lambda: engine, tmp_path_factory.mktemp("bench-store") / "responses.sqlite3", harmony_grammar=False)
    with LiveServer(app, kind="tiny") as server:
        yield server


def scrape(server: LiveServer) -> dict:
    return parse_metrics(httpx.get(f"{server.url}/metrics").text)


def counter_delta(before: dict, after: dict, name: str, **labels: str) -> float:
    def total(samples):
        return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))

    return total(after) - total(before)


# --- workloads ------------------------------------------------------------------------------


def test_random_prompts_have_exact_token_lengths():
    rng = random.Random(3)
    for length in (1, 2, 17, 257, 2000):
        assert len(encode_text(random_prompt(rng, length))) == length
    a = random_requests(6, 100, 20, range_ratio=0.5, seed=1)
    assert a == random_requests(6, 100, 20, range_ratio=0.5, seed=1)  # seeded
    assert [r.prompt for r in a] != [r.prompt for r in random_requests(6, 100, 20, range_ratio=0.5, seed=2)]
    for r in a:
        assert 50 <= r.prompt_len <= 150 and len(encode_text(r.prompt)) == r.prompt_len
        assert 10 <= r.output_len <= 30
    assert len({r.prompt_len for r in a}) > 1
    assert {(r.prompt_len, r.output_len) for r in random_requests(4, 33, 7)} == {(33, 7)}


def test_dataset_files(tmp_path):
    records = [
        {"prompt": "Name three rivers.", "output_len": 7},
        {"prompt": ""},  # skipped: no prompt
        {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "General Kenobi!"}]},
    ]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    as_array = tmp_path / "prompts.json"
    as_array.write_text(json.dumps(records))
    for path in (jsonl, as_array):
        requests = dataset_requests(path, 2, seed=0)
        by_prompt = {r.prompt: r for r in requests}
        assert set(by_prompt) == {"Name three rivers.", "Hi there"}
        assert by_prompt["Name three rivers."].output_len == 7
        assert by_prompt["Hi there"].output_len == len(encode_text("General Kenobi!"))
        assert by_prompt["Hi there"].prompt_len == len(encode_text("Hi there"))
    cycled = dataset_requests(jsonl, 5, output_len=3)
    assert len(cycled) == 5 and {r.output_len for r in cycled} == {3}
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="no usable prompts"):
        dataset_requests(empty, 1)


# --- load -----------------------------------------------------------------------------------


def test_arrivals_follow_the_rate_and_burstiness():
    assert arrival_gaps(5, math.inf, 1.0, seed=0) == [0.0] * 5
    poisson = arrival_gaps(4001, 10.0, 1.0, seed=0)
    regular = arrival_gaps(4001, 10.0, 4.0, seed=0)
    assert poisson[0] == 0.0 and len(poisson) == 4001
    for gaps, cv in ((poisson[1:], 1.0), (regular[1:], 0.5)):  # gamma: mean 1/rate, cv 1/sqrt(shape)
        mean = sum(gaps) / len(gaps)
        std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
        assert mean == pytest.approx(0.1, rel=0.08) and std / mean == pytest.approx(cv, rel=0.1)


async def test_max_concurrency_caps_requests_in_flight():
    in_flight, peak = 0, 0

    async def send(req: BenchRequest) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestResult(req.prompt_len, req.output_len, ok=True, e2e=0.01)

    requests = [BenchRequest("x", i, 1) for i in range(12)]
    results, _, duration = await drive(requests, send, max_concurrency=3, progress=False)
    assert peak == 3 and [r.prompt_len for r in results] == list(range(12)) and duration >= 0.04
    peak = 0
    await drive(requests, send, progress=False)
    assert peak == 12


def test_load_shares_split_rate_and_concurrency():
    load = Load(request_rate=12.0, burstiness=0.5, max_concurrency=7, seed=3)
    shares = [load.share(i, 3) for i in range(3)]
    assert [s.max_concurrency for s in shares] == [3, 2, 2]  # 7 in flight in all
    assert all(s.request_rate == 4.0 and s.burstiness == 0.5 for s in shares)
    assert len({s.seed for s in shares}) == 3  # arrivals of their own
    assert Load().share(1, 4).max_concurrency is None and math.isinf(Load().share(1, 4).request_rate)


async def test_requests_sent_from_two_client_processes(bench_server):
    """The requests dealt to two processes, which start together: every one served, the
    results back in request order, the run's span covering both processes' requests."""
    requests = random_requests(5, input_len=16, output_len=6, range_ratio=0.5, seed=4)
    target = ServeTarget(base_url=bench_server.url, model=MODEL, ignore_eos=True, temperature=0, timeout=120)
    before = scrape(bench_server)
    results, start, duration = await drive_in_processes(target, requests, Load(max_concurrency=3), processes=2)
    after = scrape(bench_server)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.prompt_len for r in results] == [q.prompt_len for q in requests]
    assert [r.output_tokens for r in results] == [q.output_len for q in requests]  # ignore_eos: exact
    assert counter_delta(before, after, "oss_agent_generation_tokens_total") == sum(q.output_len for q in requests)
    assert all(start <= r.start and r.start + r.e2e <= start + duration + 1e-6 for r in results)


# --- statistics -----------------------------------------------------------------------------


def test_percentiles_interpolate():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_summary_numbers():
    a = RequestResult(
        10,
        11,
        ok=True,
        start=0.0,
        ttft=0.1,
        e2e=1.1,
        input_tokens=50,
        output_tokens=11,
        delta_times=[0.15 + 0.1 * i for i in range(11)],
    )
    b = RequestResult(
        20,
        6,
        ok=True,
        start=0.5,
        ttft=0.3,
        e2e=0.8,
        input_tokens=60,
        output_tokens=6,
        delta_times=[0.85, 0.95, 1.05, 1.15, 1.25, 1.35],
    )
    failed = RequestResult(30, 6, error="HTTP 500: boom", start=0.2, e2e=0.1)
    s = summarize([a, b, failed], duration=2.0, start=0.0, backend="test")
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"HTTP 500: boom": 1})
    assert (s["total_input_tokens"], s["input_tokens_counted_by"]) == (110, "usage")
    assert s["total_output_tokens"] == 17 and s["output_throughput"] == 8.5 and s["request_throughput"] == 1.0
    assert s["total_token_throughput"] == (110 + 17) / 2
    assert s["peak_output_throughput"] == pytest.approx(11)  # 9 + 2 tokens in the first second
    assert s["ttft_ms"] == pytest.approx({"mean": 200, "median": 200, "p90": 280, "p99": 298})
    assert s["tpot_ms"] == pytest.approx({"mean": 100, "median": 100, "p90": 100, "p99": 100})  # 1.0/10, 0.5/5
    assert s["itl_ms"] == pytest.approx({"mean": 100, "median": 100, "p90": 100, "p99": 100})
    assert s["e2e_ms"]["mean"] == pytest.approx(950)
    # A server that reports no input usage: the prompt text's own tokens are counted instead.
    b.input_tokens = None
    fallback = summarize([a, b], duration=2.0, start=0.0)
    assert (fallback["total_input_tokens"], fallback["input_tokens_counted_by"]) == (30, "o200k (prompt text only)")
    nothing = json_safe(summarize([failed], duration=1.0, start=0.0, request_rate=math.inf))
    assert nothing["ttft_ms"]["mean"] is None and nothing["completed"] == 0 and nothing["request_rate"] == "inf"
    json.dumps(nothing, allow_nan=False)


def test_stream_check_rejects_malformed_streams():
    def run(api, events):
        check = StreamCheck(api, RequestResult(1, 4, start=0.0))
        for i, data in enumerate(events):
            check.feed(data if isinstance(data, str) else json.dumps(data), 0.1 * (i + 1))
        return check.finish(1.0)

    chunk = lambda **delta: {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}  # noqa: E731
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    good = run(
        "chat",
        [chunk(role="assistant", content=""), chunk(content="a"), chunk(reasoning_content="b"), end, usage, "[DONE]"],
    )
    assert good.ok and good.text == "ab" and good.ttft == pytest.approx(0.2) and good.output_tokens == 4
    assert good.delta_times == pytest.approx([0.2, 0.3]) and good.input_tokens == 9
    assert run("chat", [chunk(content="a"), "[DONE]"]).error == "the stream ended without a finish_reason"
    assert run("chat", [chunk(content="a"), end]).error == "the stream ended early"
    assert run("chat", [chunk(content="a"), {"error": {"message": "bad"}}, "[DONE]"]).error.startswith("error in")
    no_usage = run("chat", [chunk(content=" hello world"), end, "[DONE]"])
    assert no_usage.ok and (no_usage.output_tokens, no_usage.output_counted_by) == (2, "o200k")

    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1"}}
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "delta": "hi"}
    done = {
        "type": "response.completed",
        "sequence_number": 2,
        "response": {"status": "completed", "usage": {"input_tokens": 5, "output_tokens": 3}},
    }
    ok = run("responses", [created, delta, done])
    assert ok.ok and ok.response_id == "resp_1" and ok.output_tokens == 3 and ok.finish_reason == "completed"
    assert "arrived where 1 was due" in run("responses", [created, {**done, "sequence_number": 2}]).error
    assert "not response.created" in run("responses", [{**delta, "sequence_number": 0}]).error
    assert run("responses", [created, delta]).error == "the stream ended early"
    failed = {"type": "response.failed", "sequence_number": 2, "response": {"error": {"message": "engine died"}}}
    assert run("responses", [created, delta, failed]).error == "response failed: engine died"


# --- against a live server --------------------------------------------------------------------


def test_ignore_eos_generates_past_the_end_of_turn(bench_server):
    """The Chat extension the benchmark relies on for exact output lengths."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "logit_bias": {str(RETURN): 100},
    }  # the model wants to end its turn at once
    stops = httpx.post(f"{bench_server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert stops["usage"]["completion_tokens"] == 1 and stops["choices"][0]["finish_reason"] == "stop"
    goes_on = httpx.post(f"{bench_server.url}/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert goes_on.status_code == 200, goes_on.text
    assert goes_on.json()["usage"]["completion_tokens"] == 6
    assert goes_on.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_bench_serve_chat_agrees_with_the_server_metrics(bench_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    before = scrape(bench_server)
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            f"{bench_server.url}/v1",
            "--num-prompts",
            "8",
            "--input-len",
            "32",
            "--output-len",
            "64",
            "--ignore-eos",
            "--temperature",
            "0",
            "--max-concurrency",
            "4",
            "--server-metrics",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    after = scrape(bench_server)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "| successful requests | 8 |" in printed and "the server's own metrics" in printed
    s = json.loads(out.read_text())
    server = s["server_metrics"]
    assert (s["completed"], s["failed"], s["model"]) == (8, 0, MODEL)
    # Exact lengths: prompts of 32 o200k tokens, 64 output tokens each (ignore_eos), as reported.
    assert s["total_prompt_text_tokens"] == 8 * 32
    assert (s["total_output_tokens"], s["output_tokens_counted_by"]) == (8 * 64, "usage")
    # Token and request counts are the server's own.
    assert server["requests_by_status"] == {"200": 8}
    assert server["generation_tokens"] == s["total_output_tokens"]
    assert (server["prompt_tokens"], s["input_tokens_counted_by"]) == (s["total_input_tokens"], "usage")
    assert server["ttft_count"] == 8
    # ... and so are they when scraped independently around the whole run (one warm-up request more).
    assert counter_delta(before, after, "oss_agent_generation_tokens_total") == 9 * 64
    assert counter_delta(before, after, "oss_agent_requests_total", endpoint="/v1/chat/completions", status="200") == 9
    # Latencies: the client's first text comes after the server's first token; the gaps between
    # streamed deltas are the engine's gaps between tokens; a request lasts as long on both sides.
    assert s["ttft_ms"]["mean"] >= server["ttft_mean_ms"]
    assert 1 / 3 < s["itl_ms"]["mean"] / server["tpot_mean_ms"] < 3
    assert s["e2e_ms"]["mean"] == pytest.approx(server["request_duration_mean_ms"], rel=0.25, abs=50)
    assert s["output_throughput"] == pytest.approx(512 / s["duration_s"])
    assert s["peak_output_throughput"] > 0


def test_bench_serve_responses_api_with_a_dataset(bench_server, tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        "\n".join(
            json.dumps({"prompt": p, "output_len": n})
            for p, n in [("Why is the sky blue?", 12), ("Name a prime number.", 8)]
        )
    )
    out = tmp_path / "responses.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            bench_server.url,
            "--api",
            "responses",
            "--dataset",
            str(dataset),
            "--num-prompts",
            "4",
            "--request-rate",
            "20",
            "--server-metrics",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().out
    s = json.loads(out.read_text())
    assert (s["completed"], s["failed"], s["output_tokens_counted_by"]) == (4, 0, "usage")
    assert 4 <= s["total_output_tokens"] <= 2 * 12 + 2 * 8
    assert s["server_metrics"]["generation_tokens"] == s["total_output_tokens"]
    assert s["server_metrics"]["requests_by_status"] == {"200": 4}
    assert s["ttft_ms"]["mean"] >= s["server_metrics"]["ttft_mean_ms"]
    assert s["e2e_ms"]["p99"] >= s["e2e_ms"]["median"] > 0


def test_bench_serve_reports_failures(bench_server, tmp_path, capsys):
    out = tmp_path / "failed.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            bench_server.url,
            "--model",
            "no-such-model",
            "--warmup",
            "0",
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert rc == 1
    s = json.loads(out.read_text())
    assert (s["completed"], s["failed"]) == (0, 3)
    [(message, count)] = s["errors"].items()
    assert message.startswith("HTTP 404: The model 'no-such-model' does not exist") and count == 3
    assert "failed x3: HTTP 404" in capsys.readouterr().out
    # A failing warm-up stops the run before it starts.
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            bench_server.url,
            "--model",
            "no-such-model",
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--no-progress",
        ]
    )
    assert rc == 1 and "the warm-up request failed: HTTP 404" in capsys.readouterr().err


def test_bench_serve_against_a_closed_port_names_the_url(capsys):
    # It said "All connection attempts failed", and not where it had tried.
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listening:
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--no-progress"]
    assert main(["bench", "serve", "--base-url", url, *args]) == 1
    assert f"bench serve: cannot reach {url}: " in capsys.readouterr().err
    # With --model (no /v1/models request first), the warm-up or each request names it.
    assert main(["bench", "serve", "--base-url", url, "--model", "m", *args]) == 1
    assert f"({url}/v1/chat/completions)" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", url, "--model", "m", "--warmup", "0", *args]) == 1
    assert f"({url}/v1/chat/completions)" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_engine_and_its_http_overhead_in_one_run(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = main(
        [
            "bench",
            "engine",
            "--model",
            str(tiny_checkpoint),
            "--device",
            "cpu",
            "--max-model-len",
            "1024",
            "--engine-option",
            "num_pages=256",
            "--engine-option",
            "enforce_eager=True",
            "--num-prompts",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--ignore-eos",
            "--temperature",
            "0",
            "--compare-http",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    engine, http = report["engine"], report["http"]
    for s in (engine, http):
        assert (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 0, 32)
    assert engine["output_tokens_counted_by"] == "engine" and http["output_tokens_counted_by"] == "usage"
    # The engine is given exactly the prompt the server renders for the same Chat request.
    assert engine["total_input_tokens"] == http["total_input_tokens"] > 4 * 16
    assert engine["ttft_ms"]["mean"] > 0 and engine["tpot_ms"]["mean"] > 0
    assert http["server_metrics"]["generation_tokens"] == 32
    ratios = report["http_over_engine"]
    assert ratios["output token throughput (tok/s)"] == pytest.approx(
        http["output_throughput"] / engine["output_throughput"]
    )
    assert "streaming overhead" in printed and "| output token throughput (tok/s) |" in printed
    # Where the engine's time went: every token of the run in some step, each step charged its
    # wall time (all synchronous on the CPU), together no more than the run took.
    steps = engine["engine_steps"]
    decoded = sum(steps[k]["steps"] * steps[k]["mean_decode_tokens"] for k in ("decode", "mixed") if steps[k]["steps"])
    prefilled = sum(
        steps[k]["steps"] * steps[k]["mean_prefill_tokens"] for k in ("mixed", "prefill") if steps[k]["steps"]
    )
    assert decoded == pytest.approx(4 * 7)  # the first token of each comes from its prompt's step
    assert prefilled == pytest.approx(engine["total_input_tokens"] - engine["prefix_hit_tokens"])
    total = sum(steps[k]["steps"] for k in ("decode", "mixed", "prefill"))
    assert steps["synchronous"]["steps"] == total >= 8
    busy = sum(steps[k]["seconds"] for k in ("decode", "mixed", "prefill"))
    assert 0 < busy <= engine["duration_s"] + 0.05 and steps["idle"]["seconds"] == pytest.approx(
        engine["duration_s"] - busy
    )
    assert "where the engine's time went" in printed and "| decode | " in printed
    # Each kind's step durations and the gaps between a sequence's tokens, from histograms.
    gaps = steps["token_gaps_ms"]
    assert 0 < gaps["median_ms"] <= gaps["p90_ms"] <= gaps["p99_ms"] < 1e3 * engine["duration_s"]
    assert steps["decode"]["median_ms"] <= steps["decode"]["p99_ms"] and steps["decode"]["median_ms"] > 0
    assert "gaps between a sequence's tokens as the engine hands them out" in printed


def test_sse_lines_end_only_where_the_sse_format_ends_them():
    from agent_server.bench.serve import sse_events

    pieces = [
        b'data: {"a":"x\xe2\x80',
        b'\xa8y\xc2\x85z\xe2\x80\xa9"}\r',
        b"\n\r\ndata: 1\rdata: 2\r",
        b"\r",
        b"data: [DONE]",
    ]

    async def body():
        for piece in pieces:
            yield piece

    async def read() -> list[str]:
        return [e async for e in sse_events(httpx.Response(200, content=body()))]

    # U+2028, U+0085 and U+2029 stay inside the first event; CRLF, CR and a CR cut from its LF end lines.
    assert asyncio.run(read()) == ['{"a":"x\u2028y\x85z\u2029"}', "1\n2", "[DONE]"]


def test_bench_serve_scrapes_the_metrics_with_the_api_key(tmp_path, capsys):
    from tests.fake_engine import ScriptedEngine

    engine = ScriptedEngine()
    app = make_app(lambda: engine, tmp_path / "r.db", api_key="k3y")
    with LiveServer(app, api_key="k3y") as server:
        out = tmp_path / "serve.json"
        rc = main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--api-key",
                "k3y",
                "--num-prompts",
                "2",
                "--input-len",
                "16",
                "--output-len",
                "4",
                "--server-metrics",
                "--no-progress",
                "--json",
                str(out),
            ]
        )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "not available" not in printed
    assert json.loads(out.read_text())["server_metrics"]["requests_by_status"] == {"200": 2}


async def test_loopback_server_shuts_the_engine_down_when_the_app_cannot_be_made(monkeypatch):
    """Its engine process would otherwise outlive the benchmark, which then never exits."""
    from agent_server.bench.engine import loopback_server

    class Engine:
        model_name, stopped = "m", False

        async def shutdown(self):
            self.stopped = True

    monkeypatch.setitem(sys.modules, "agent_server.app", None)  # its import fails
    engine = Engine()
    with pytest.raises(ImportError):
        async with loopback_server(engine):
            pass
    assert engine.stopped
