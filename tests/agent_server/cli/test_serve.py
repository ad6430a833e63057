"""`oss-agent serve` engine flags (--gpu-memory-utilization, --num-pages, --max-num-seqs, the step
budgets, --kv-cache-dtype) reach
the engine's `EngineConfig`. uvicorn is not started; the app serve makes is then served for real,
so its startup builds the engine from the flags on the tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from agent_server.cli.main import build_parser
from tests.conftest import LiveServer, serve_captured


def serve(checkpoint, tmp_path, *flags: str):
    """The app `oss-agent serve --model CHECKPOINT --device cpu --store TMP/r.db FLAGS` would serve."""
    argv = ["--model", str(checkpoint), "--device", "cpu", "--store", str(tmp_path / "r.db"), *flags]
    return serve_captured(argv)["app"]


def test_engine_flags_reach_the_engine_config(tiny_checkpoint, tmp_path):
    app = serve(
        tiny_checkpoint,
        tmp_path,
        "--gpu-memory-utilization",
        "0.55",
        "--num-pages",
        "96",
        "--max-num-seqs",
        "8",
        "--kv-cache-dtype",
        "fp8",
        "--max-num-batched-tokens",
        "512",
        "--max-prefill-tokens-decoding",
        "none",
        "--engine-option",
        "num_pages=500",
        "--engine-option",
        "max_prefill_tokens_decoding=64",
        "--engine-option",
        "enforce_eager=True",
    )
    with LiveServer(app) as server:
        engine = server.engine.engine  # AsyncEngine -> LLMEngine
        config = engine.config
        assert (config.gpu_memory_utilization, config.num_pages, config.max_num_seqs) == (0.55, 96, 8)
        assert config.enforce_eager is True  # --engine-option still works beside the flags
        assert engine.cache.full.num_pages == 96 and engine.stats().pages_total == 96
        assert engine.scheduler.max_num_seqs == 8
        # none is the engine's None (no prefill cap), and the flag wins over --engine-option.
        assert (config.max_num_batched_tokens, config.max_prefill_tokens_decoding) == (512, None)
        assert (engine.scheduler.max_num_batched_tokens, engine.scheduler.max_prefill_tokens_decoding) == (512, None)
        assert config.kv_cache_dtype == "fp8" and engine.kv_caches[0][0].dtype == torch.float8_e4m3fn


def test_engine_flags_default_to_the_engine_defaults(tiny_checkpoint, tmp_path):
    from inference.config import EngineConfig

    app = serve(tiny_checkpoint, tmp_path)
    with LiveServer(app) as server:
        config = server.engine.engine.config
        assert (config.gpu_memory_utilization, config.num_pages, config.max_num_seqs) == (
            EngineConfig.gpu_memory_utilization,
            None,
            EngineConfig.max_num_seqs,
        )
        assert config.kv_cache_dtype == "auto" and server.engine.engine.kv_caches[0][0].dtype == torch.float32
        assert (config.max_num_batched_tokens, config.max_prefill_tokens_decoding) == (
            EngineConfig.max_num_batched_tokens,
            EngineConfig.max_prefill_tokens_decoding,
        )


def test_prefill_cap_flag_takes_a_number(tiny_checkpoint, tmp_path):
    app = serve(
        tiny_checkpoint,
        tmp_path,
        "--num-pages",
        "96",
        "--max-prefill-tokens-decoding",
        "48",
    )
    with LiveServer(app) as server:
        assert server.engine.engine.scheduler.max_prefill_tokens_decoding == 48


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--gpu-memory-utilization", "0"),
        ("--gpu-memory-utilization", "1.5"),
        ("--num-pages", "0"),
        ("--max-num-seqs", "-1"),
        ("--kv-cache-dtype", "fp16"),
        ("--max-num-batched-tokens", "0"),
        ("--max-prefill-tokens-decoding", "0"),
        ("--max-prefill-tokens-decoding", "lots"),
        ("--gpu-memory-utilization", "lots"),
    ],
)
def test_bad_engine_flags_are_refused_by_name(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", flag, value])
    assert info.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.slow
def test_engine_process_flag_serves_the_same_engine_in_a_child_process(tiny_checkpoint, tmp_path):
    import os

    from inference.engine.async_engine import AsyncEngine
    from inference.engine.process import EngineProcess

    app = serve(
        tiny_checkpoint,
        tmp_path,
        "--engine-process",
        "--num-pages",
        "96",
        "--max-model-len",
        "256",
    )
    with LiveServer(app) as server:
        engine = server.engine
        assert isinstance(engine, EngineProcess) and engine.pid != os.getpid()
        assert engine.stats().pages_total == 96 and engine.max_model_len == 256
        reply = server.client().chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens == 4
    app = serve(tiny_checkpoint, tmp_path)
    with LiveServer(app) as server:  # on CPU the default is the engine thread
        assert isinstance(server.engine, AsyncEngine)


@pytest.mark.parametrize(
    "argv,cuda,expected",
    [
        ([], True, True),
        ([], False, False),
        (["--device", "cpu"], True, False),
        (["--device", "cuda:1"], False, True),
        (["--no-engine-process"], True, False),
        (["--engine-process", "--device", "cpu"], False, True),
    ],
)
def test_engine_process_default_follows_the_device(argv, cuda, expected, monkeypatch):
    import torch

    from agent_server.cli.serve import engine_in_process_of_its_own

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert engine_in_process_of_its_own(build_parser().parse_args(["serve", *argv])) is expected


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--device", "cpu", "--max-model-len", "512", "--no-engine-process"],
        ["--engine-option=num_pages=64", "--engine-option", "enforce_eager=True", "--engine-process"],
    ],
)
def test_engine_placement_flags_survive_being_handed_on(argv):
    """What a benchmark script hands on to `bench engine` is what its own command line said."""
    import argparse

    from agent_server.cli.serve import add_engine_placement_arguments, engine_placement_argv

    parser = argparse.ArgumentParser()
    add_engine_placement_arguments(parser)
    first = parser.parse_args(argv)
    assert parser.parse_args(engine_placement_argv(first)) == first
