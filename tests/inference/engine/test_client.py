"""`RequestStream`: deltas that piled up while the reader was busy come out merged; a reader
that keeps up gets each delta as the engine sent it (`inference/engine/client.py`)."""

from __future__ import annotations

import asyncio

from inference.engine.client import StreamingEngineClient, merge_deltas
from inference.request import GenerationRequest, SamplingParams, TokenDelta, TokenLogprob


class QueueClient(StreamingEngineClient):
    """The engine side is the test: it puts deltas into the request's queue by hand."""

    max_model_len, vocab_size = 100, 1000

    def __init__(self):
        super().__init__()
        self.queues: dict[str, asyncio.Queue] = {}
        self.submitted: list[tuple] = []

    def _check_serving(self) -> None:
        pass

    def _open(self, request, queue) -> None:
        self.queues[request.request_id] = queue

    def _submit(self, command: tuple) -> None:
        self.submitted.append(command)


def request(rid: str = "r") -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=8, logprobs=1))


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, [(token, -0.5)])


async def test_deltas_that_piled_up_come_out_as_one():
    client = QueueClient()
    stream = client.generate(request())
    stream.open()
    queue = client.queues["r"]
    queue.put_nowait(TokenDelta("r", [5], [lp(5)], num_prompt_tokens=3))
    queue.put_nowait(TokenDelta("r", [6, 7], [lp(6), lp(7)], num_prompt_tokens=3, num_cached_tokens=2))
    first = await stream.__anext__()
    assert first.token_ids == [5, 6, 7] and [x.token_id for x in first.logprobs] == [5, 6, 7]
    assert first.finish_reason is None and (first.num_prompt_tokens, first.num_cached_tokens) == (3, 2)

    # The last delta merges too, and ends the stream: its finish and stop token are the merged one's.
    queue.put_nowait(TokenDelta("r", [8], [lp(8)]))
    queue.put_nowait(TokenDelta("r", [9], [lp(9)], finish_reason="stop", stop_token_id=9))
    queue.put_nowait(TokenDelta("r", [], finish_reason="abort"))  # nothing is read past the end
    last = await stream.__anext__()
    assert (last.token_ids, last.finish_reason, last.stop_token_id) == ([8, 9], "stop", 9)
    assert [d async for d in stream] == [] and "r" not in client._active and client.submitted == []


async def test_a_reader_that_keeps_up_gets_every_delta_as_sent():
    client = QueueClient()
    stream = client.generate(request())
    stream.open()
    queue = client.queues["r"]
    seen = []
    for token, finish in ((5, None), (6, None), (7, "length")):
        queue.put_nowait(TokenDelta("r", [token], [lp(token)], finish_reason=finish))
        seen.append(await stream.__anext__())
    assert [d.token_ids for d in seen] == [[5], [6], [7]] and seen[-1].finish_reason == "length"


def test_merge_keeps_the_order_and_the_later_counts():
    merged = merge_deltas(
        TokenDelta("r", [1], None, num_prompt_tokens=4), TokenDelta("r", [2], [lp(2)], "error", error="boom")
    )
    assert merged.token_ids == [1, 2] and [x.token_id for x in merged.logprobs] == [2]
    assert (merged.finish_reason, merged.error, merged.num_prompt_tokens) == ("error", "boom", 0)
    assert merge_deltas(TokenDelta("r", [1]), TokenDelta("r", [2])).logprobs is None
