"""`oss-agent serve --tensor-parallel-size 4` on 4 GPUs: the Responses API answers, and a rank
that stops mid-stream ends the stream and turns /health 503 within seconds, naming the rank.

The server runs as the command (a process of its own, its engine in a process of its own on
CUDA, that one's 3 workers beside it), on a tiny random checkpoint shaped to split 4 ways (4 KV
heads, 4 MXFP4 blocks of expert columns). Skips without 4 GPUs.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.process_tree import serve_process, spawned_children, wait_until

pytestmark = pytest.mark.gpu(count=4)


def test_serve_on_four_gpus_answers_and_reports_a_stopped_rank(tmp_path):
    from openai import OpenAI

    from inference.model.tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "tiny-tp4", seed=0, num_key_value_heads=4, intermediate_size=128)
    with serve_process(
        tmp_path,
        "--model",
        str(model),
        "--served-model-name",
        "tiny-tp4",
        "--tensor-parallel-size",
        "4",
        "--store",
        str(tmp_path / "r.db"),
        "--num-pages",
        "512",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "16",
        ready_timeout=900,
    ) as (server, base, _):
        engine = next(pid for pid in spawned_children(server.pid) if len(spawned_children(pid)) == 3)
        workers = spawned_children(engine)

        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.responses.create(model="tiny-tp4", input="Say hi.", max_output_tokens=24)
        assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens > 0
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}

        ended = {}

        def stream():  # a long generation, its stream read to the end (or to its error)
            try:
                with client.responses.stream(model="tiny-tp4", input="Count.", max_output_tokens=4000) as events:
                    for event in events:
                        ended.setdefault("first", time.monotonic())
            except Exception as e:
                ended["error"] = repr(e)
            ended["at"] = time.monotonic()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_until(lambda: "first" in ended, 120, "the stream's first event")
        os.kill(workers[1], signal.SIGSTOP)  # a rank, mid-generation: rank 0 waits in a collective
        stopped = time.monotonic()
        health = wait_until(
            lambda: (r := httpx.get(f"{base}/health", timeout=5)).status_code == 503 and r, 30, "/health 503"
        )
        took = time.monotonic() - stopped
        assert re.search(r"rank [123] stopped responding", health.json()["error"]), health.json()
        assert took < 20, took
        reader.join(30)
        assert "at" in ended, "the stream did not end"
