"""benchmarks/bench_http.py (docs/design.md §3's HTTP targets) and the random-weight engine it serves, on CPU.

On the GPU the script builds full-size random weights; here the same code paths run on the tiny
shapes: `LLMEngine.from_random`, `oss-agent bench engine --random-weights`, and the script's
workloads with smaller lengths, engine and HTTP side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

import tests.triton_interpreter  # noqa: F401  (first: sets TRITON_INTERPRET on CPU before the engine imports triton)
from agent_server.bench import engine as bench_engine
from agent_server.cli.main import main
from inference.config import GPT_OSS_SHAPES, ModelConfig
from inference.engine.core import LLMEngine
from inference.model.tiny_checkpoint import hf_config_dict
from tests.benchmark_scripts import load_benchmark
from tests.gpu_comparison import greedy

TINY = ModelConfig.from_dict(hf_config_dict())
OPTIONS = dict(device="cpu", max_model_len=256, num_pages=64, enforce_eager=True)


def test_random_weight_engine_builds_its_seed_and_options():
    a = LLMEngine.from_random(TINY, seed=0, **OPTIONS)
    assert a.max_model_len == 256 and a.model.max_positions == 256
    assert a.model.config == TINY and a.model_name == "gpt-oss-random"
    prompt = [200006, 1428, 200008, 1645, 3021, 200007]
    first = greedy(a, [prompt], 6)[0][0]
    assert len(first) == 6
    assert greedy(LLMEngine.from_random(TINY, seed=0, **OPTIONS), [prompt], 6)[0][0] == first
    # Another seed is other weights.
    b = LLMEngine.from_random(TINY, seed=1, **OPTIONS)
    assert not b.model.embed.weight.equal(a.model.embed.weight)


def test_random_weight_engine_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="one device"):
        LLMEngine.from_random(TINY, tensor_parallel_size=2, **OPTIONS)
    with pytest.raises(TypeError, match="unknown engine options: pages"):
        LLMEngine.from_random(TINY, pages=3, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["--no-engine-process", "--engine-process"])
def test_bench_engine_with_random_weights(where, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(GPT_OSS_SHAPES, "tiny", {})  # hf_config_dict's tiny defaults
    out = tmp_path / "random.json"
    rc = main(
        [
            "bench",
            "engine",
            "--random-weights",
            "tiny",
            "--device",
            "cpu",
            "--max-model-len",
            "256",
            "--engine-option",
            "num_pages=64",
            "--engine-option",
            "enforce_eager=True",
            "--num-prompts",
            "2",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--ignore-eos",
            "--no-progress",
            "--json",
            str(out),
            where,
        ]
    )
    assert rc == 0, capsys.readouterr()
    assert ("in an engine process" in capsys.readouterr().err) == (where == "--engine-process")
    report = json.loads(out.read_text())["engine"]
    assert report["model"] == "gpt-oss-tiny-random"
    assert (report["completed"], report["total_output_tokens"]) == (2, 8)
    with pytest.raises(SystemExit):  # a checkpoint and random weights at once
        main(["bench", "engine", "--random-weights", "tiny", "--model", str(tmp_path)])


@pytest.mark.slow
def test_bench_http_workloads_engine_and_http_side_by_side(monkeypatch):
    bench_http = load_benchmark("bench_http")
    monkeypatch.setitem(GPT_OSS_SHAPES, "tiny", {})
    monkeypatch.setattr(
        bench_http, "WORKLOADS", {"ttft": (24, 1, 1, 0.0), "c1": (24, 6, 1, 0.0), "c64": (24, 6, 3, 0.0)}
    )
    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    base = parser.parse_args(
        [
            "--random-weights",
            "tiny",
            "--device",
            "cpu",
            "--ignore-eos",
            "--no-progress",
            "--max-model-len",
            "256",
            "--engine-option=num_pages=128",
            "--engine-option=enforce_eager=True",
        ]
    )
    runs = {name: bench_http.workload_args(base, name, 3) for name in ("ttft", "c1", "c64")}
    assert (runs["c64"].input_len, runs["c64"].output_len, runs["c64"].max_concurrency) == (24, 6, 3)
    report = asyncio.run(bench_http.measure(bench_engine.build_engine(base), runs, rounds=2))

    for name, outputs in (("ttft", 1), ("c1", 6), ("c64", 6)):
        assert len(report[name]) == 2
        for run in report[name]:
            for side in ("engine", "http"):
                s = run[side]
                assert (s["completed"], s["failed"], s["total_output_tokens"]) == (3, 0, 3 * outputs), (name, side)
                assert s["ttft_ms"]["mean"] > 0
            # Both sides were given the prompt the server renders for the same message length.
            assert run["engine"]["total_input_tokens"] == run["http"]["total_input_tokens"] > 3 * 24
            # ... and no round reused another's prompts: the cache serves at most the template.
            template = run["engine"]["total_input_tokens"] // 3 - 24
            assert run["engine"]["prefix_hit_tokens"] <= 3 * template
    # One output token: the HTTP side's first text is that token, so its TTFT is the whole request.
    ttft = report["ttft"][0]["http"]
    assert ttft["ttft_ms"]["mean"] <= ttft["e2e_ms"]["mean"]
    assert ttft["server_metrics"]["generation_tokens"] == 3

    table = bench_http.format_report(report, "title")
    assert "| ttft | 1 | TTFT mean (ms) |" in table and "| ttft | 2 | server's own TTFT mean" in table
    for name in ("c1", "c64"):
        assert f"| {name} | all | **streaming overhead**" in table
        for r, run in enumerate(report[name], 1):
            ratio = run["http"]["output_throughput"] / run["engine"]["output_throughput"]
            assert f"| {name} | {r} | output tok/s |" in table and f"{ratio:.3f}" in table
