"""`oss-agent serve --data-parallel-size 2`: two engine processes behind one server (on the CPU
here, the tiny model; on GPUs each replica takes its own). Requests spread by load, a prompt
sharing a seen prefix follows its replica, an agent continuation stays on its replica, /metrics
has each replica and the total, and a replica killed mid-stream ends that stream with an error
while the other goes on serving (/health "degraded", not 503)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from agent_server.bench.server_metrics import parse_metrics
from tests.process_tree import serve_process, spawned_children, wait_until

pytestmark = pytest.mark.slow  # a long end-to-end run: CI runs it with `-m slow`


def _metric(base: str, name: str, **labels) -> float:
    samples = parse_metrics(httpx.get(f"{base}/metrics", timeout=10).text)
    return sum(
        v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == w for k, w in labels.items())
    )


@pytest.fixture
def server(tmp_path):
    with serve_process(
        tmp_path,
        "--data-parallel-size",
        "2",
        "--device",
        "cpu",
        "--store",
        str(tmp_path / "r.db"),
        "--tool-server",
        "python",
    ) as running:
        yield running


def test_two_replicas_route_by_load_prefix_and_continuation_and_survive_one_dying(server):
    from openai import OpenAI

    proc, base, log = server
    engines = spawned_children(proc.pid)
    assert len(engines) == 2, engines
    assert httpx.get(f"{base}/health").json() == {"status": "ok", "replicas": {"total": 2, "in_rotation": 2}}
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    model = client.models.list().data[0].id

    def ask(text, max_tokens=8):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0
        )

    # Requests in flight together spread over both replicas by load: each is held open (its
    # first chunk read) while the next is sent.
    held = []
    for i in range(3):
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"distinct prompt number {i} " * 6}],
            max_tokens=2000,
            stream=True,
        )
        next(iter(stream))
        held.append(stream)
    routed = [_metric(base, "oss_agent_replica_routed_requests_total", replica=str(i)) for i in (0, 1)]
    for stream in held:
        stream.close()
    assert sorted(routed) == [1, 2], routed

    # A long shared prefix, asked again: routed to the replica that has it, and served from cache.
    shared = "You are a careful assistant who answers in one short sentence. " * 8
    ask(shared + "First question?")
    hits_before = _metric(base, "oss_agent_cached_prompt_tokens_total")
    by_prefix_before = _metric(base, "oss_agent_replica_routed_requests_total", reason="prefix")
    ask(shared + "Second question?")
    assert _metric(base, "oss_agent_replica_routed_requests_total", reason="prefix") == by_prefix_before + 1
    assert _metric(base, "oss_agent_cached_prompt_tokens_total") - hits_before >= 64

    # An agent turn with a forced python call continues on the replica that parked its sequence.
    cont_before = _metric(base, "oss_agent_replica_routed_requests_total", reason="continuation")
    reply = client.responses.create(
        model=model,
        input="Compute 2+2 with python.",
        tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
        tool_choice="required",
        max_output_tokens=64,
    )
    assert any(item.type == "code_interpreter_call" for item in reply.output), [i.type for i in reply.output]
    assert _metric(base, "oss_agent_replica_routed_requests_total", reason="continuation") > cont_before

    # Per-replica series beside the totals.
    total = _metric(base, "oss_agent_generation_tokens_total")
    per_replica = sum(_metric(base, "oss_agent_replica_generation_tokens_total", replica=str(i)) for i in (0, 1))
    assert per_replica > 0 and total > 0
    assert _metric(base, "oss_agent_replica_up", replica="0") == 1 == _metric(base, "oss_agent_replica_up", replica="1")

    # Kill one replica mid-stream: that stream ends with an error, the other replica serves on.
    outcome = {}

    def stream():
        try:
            with client.responses.stream(model=model, input="Count slowly.", max_output_tokens=4000) as events:
                for event in events:
                    outcome.setdefault("first", time.monotonic())
                    if event.type in ("response.failed", "error"):
                        outcome["failed"] = event.type
        except Exception as e:  # the SDK raises on an error event
            outcome["failed"] = repr(e)
        outcome["done"] = True

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    wait_until(lambda: "first" in outcome, 120, "the stream's first event")
    running = wait_until(
        lambda: [i for i in (0, 1) if _metric(base, "oss_agent_replica_running_requests", replica=str(i)) > 0],
        60,
        "the stream's request running on a replica",
    )
    assert len(running) == 1, running
    victim = running[0]
    pids = dict(re.findall(r"(\d+) on \S+ \(pid (\d+)\)", log.read_text()))
    assert sorted(int(p) for p in pids.values()) == sorted(engines), (pids, engines)
    os.kill(int(pids[str(victim)]), signal.SIGKILL)
    reader.join(60)
    assert outcome.get("done") and "failed" in outcome, outcome
    health = wait_until(
        lambda: (r := httpx.get(f"{base}/health", timeout=5)).json().get("status") == "degraded" and r, 30, "degraded"
    )
    assert health.status_code == 200
    assert health.json()["replicas"]["in_rotation"] == 1 and str(victim) in health.json()["replicas"]["out"]
    for i in range(3):
        assert ask(f"after the loss {i}").choices[0].finish_reason in ("stop", "length")
    assert _metric(base, "oss_agent_replica_up", replica=str(victim)) == 0
    assert "out of rotation" in log.read_text()
