"""An engine on the second GPU (a data-parallel replica's place, or `--device cuda:1`): Triton
launches on the calling thread's current device, so the engine makes its device current in the
threads that build and step it (`make_device_current`). Built in this thread, on the engine
thread of `AsyncEngine`, and in an engine process, it must produce the first GPU's greedy
tokens. Skips without 2 GPUs."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from tests.engine_runs import collect, tokens_of
from tests.engine_runs import greedy_request as request
from tests.gpu_comparison import compare_greedy, greedy, prompts

pytestmark = pytest.mark.gpu(count=2)
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
OPTIONS = {"dtype": torch.float32, "num_pages": 256, "page_size": 16, "max_num_batched_tokens": 8}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from inference.model.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-second-gpu"), seed=0)


def test_engine_on_the_second_gpu_equals_the_first(checkpoint):
    from inference.engine.core import LLMEngine

    batch = prompts(4, 60)
    torch.cuda.set_device(0)
    first = greedy(LLMEngine.from_pretrained(checkpoint, device="cuda:0", **OPTIONS), batch, 16)
    torch.cuda.set_device(0)  # the caller's current device is the first GPU, as a server's main thread's is
    engine = LLMEngine.from_pretrained(checkpoint, device="cuda:1", **OPTIONS)
    assert engine.model.device == torch.device("cuda:1") and engine.runner.graphs is not None
    compared, total = compare_greedy(first, greedy(engine, batch, 16), near_tie=1e-3)
    assert compared >= total // 2, (compared, total)


def test_engine_thread_and_engine_process_on_the_second_gpu(checkpoint):
    from inference.engine.async_engine import AsyncEngine
    from inference.engine.core import LLMEngine
    from inference.engine.process import EngineProcess, EngineSpec

    prompt = prompts(1, 40, seed=3)[0]
    torch.cuda.set_device(0)
    expected = tokens_of(greedy_deltas(LLMEngine.from_pretrained(checkpoint, device="cuda:0", **OPTIONS), prompt))

    async def run(client):
        try:
            return tokens_of(await collect(client.generate(request("r", prompt, 12))))
        finally:
            await client.shutdown()

    torch.cuda.set_device(0)
    threaded = AsyncEngine(LLMEngine.from_pretrained(checkpoint, device="cuda:1", **OPTIONS))
    torch.cuda.set_device(0)  # the engine thread must not depend on the builder's current device
    assert asyncio.run(run(threaded)) == expected
    options = {**OPTIONS, "dtype": "float32", "device": "cuda:1"}
    process = EngineProcess(EngineSpec(model_dir=str(checkpoint), options=options))
    assert asyncio.run(run(process)) == expected


def greedy_deltas(engine, prompt):
    from tests.engine_runs import drain

    engine.add_request(request("r", prompt, 12))
    return drain(engine)["r"]
