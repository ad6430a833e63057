"""`ReplicaRouter`: requests routed by continuation, cached prefix and load over engine replicas,
a dead replica taken out of rotation (fake replicas here; the real engine processes behind
`oss-agent serve --data-parallel-size 2`: tests/agent_server/cli/test_serve_data_parallel.py)."""

from __future__ import annotations

import asyncio

import pytest

from inference.engine.replicas import REQUEST_COST_TOKENS, PrefixIndex, ReplicaRouter
from inference.request import EngineStats, GenerationRequest, SamplingParams, TokenDelta


class FakeReplica:
    """An engine client whose streams emit `reply` then stop, once `gate` is set (so tests can
    hold requests in flight)."""

    def __init__(self, name: str, reply=(7, 8, 9)):
        self.name, self.reply = name, list(reply)
        self.model_name, self.max_model_len, self.vocab_size = "m", 4096, 1000
        self.failure: str | None = None
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.released: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.decoded = 0

    def generate(self, request):
        if self.failure:
            raise RuntimeError(self.failure)
        self.requests.append(request)
        return self._stream(request)

    async def _stream(self, request):
        await self.gate.wait()
        if self.failure:
            yield TokenDelta(request.request_id, [], finish_reason="error", error=self.failure)
            return
        self.decoded += len(self.reply)
        yield TokenDelta(
            request.request_id, self.reply, finish_reason="stop", num_prompt_tokens=len(request.prompt_token_ids)
        )

    def abort(self, request_id):
        self.aborted.append(request_id)

    def release(self, request_id):
        self.released.append(request_id)

    def stats(self):
        return EngineStats(running=1, tokens_decoded=self.decoded, pages_total=10, pages_used=2)

    async def shutdown(self):
        pass


def request(rid, prompt, **kw):
    return GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=4), **kw)


@pytest.fixture
def replicas():
    return [FakeReplica("a"), FakeReplica("b")]


def wrap(replica):
    """Give a FakeReplica's async generators the DeltaStream `open()`."""
    original = replica.generate

    class _S:
        def __init__(self, gen):
            self.gen = gen

        def open(self):
            pass

        def __aiter__(self):
            return self

        async def __anext__(self):
            return await self.gen.__anext__()

        async def aclose(self):
            await self.gen.aclose()

    replica.generate = lambda req: _S(original(req))
    return replica


def router_of(replicas):
    return ReplicaRouter([wrap(r) for r in replicas])


SHARED = list(range(100, 164))  # four whole 16-token blocks


def test_prefix_index_matches_whole_leading_blocks():
    index = PrefixIndex(block_tokens=16)
    index.record(0, index.hashes(SHARED + [1] * 16))
    index.record(1, index.hashes(SHARED[:32]))
    assert index.matches(index.hashes(SHARED + [1] * 16 + [5] * 3), 2) == [5, 2]
    assert index.matches(index.hashes([9] + SHARED), 2) == [0, 0]  # a different first block: nothing
    assert index.hashes(list(range(15))) == []  # no whole block
    index.forget(0)
    assert index.matches(index.hashes(SHARED), 2) == [0, 2]


def test_prefix_hashes_extend_from_known_ones():
    index = PrefixIndex(block_tokens=16)
    prompt, output = SHARED + [1] * 7, [2] * 30
    assert index.hashes(prompt + output, known=index.hashes(prompt)) == index.hashes(prompt + output)
    assert len(index.hashes(prompt + output)) == (len(prompt) + len(output)) // 16


def test_prefix_index_is_bounded_lru():
    index = PrefixIndex(capacity=8, block_tokens=16)
    old = index.hashes(list(range(64)))
    index.record(0, old)
    index.record(1, index.hashes(list(range(1000, 1128))))  # 8 new blocks push the old out
    assert index.matches(old, 2) == [0, 0]
    assert len(index._owners) == 8


def test_new_prompts_spread_by_load_and_a_shared_prefix_follows_its_replica(replicas):
    async def go():
        router = router_of(replicas)
        for r in replicas:
            r.gate.clear()
        # Held in flight: distinct prompts alternate by load.
        s1 = router.generate(request("r1", SHARED + [1] * 20))
        s1.open()
        s2 = router.generate(request("r2", [3] * 40))
        s2.open()
        assert [len(r.requests) for r in replicas] == [1, 1]
        # The shared prefix goes where it was seen, although both are equally loaded.
        s3 = router.generate(request("r3", SHARED + [2] * 20))
        s3.open()
        assert replicas[0].requests[-1].request_id == "r3"
        assert router.counters[0].routed_by_prefix == 1
        for r in replicas:
            r.gate.set()
        for s in (s1, s2, s3):
            assert [d.finish_reason async for d in s] == ["stop"]
        assert [c.in_flight for c in router.counters] == [0, 0]

    asyncio.run(go())


def test_a_cached_prefix_wins_until_its_replica_is_busier_by_what_the_cache_saves(replicas):
    async def go():
        router = router_of(replicas)
        for r in replicas:
            r.gate.clear()
        long_prefix = list(range(2000, 2000 + 4 * REQUEST_COST_TOKENS))  # worth 4 requests in flight
        seed = router.generate(request("seed", long_prefix + [1] * 20))
        seed.open()
        (holder,) = [i for i, r in enumerate(replicas) if r.requests]
        streams = [seed]
        for i in range(7):
            s = router.generate(request(f"p{i}", long_prefix + [i + 10] * 20))
            s.open()
            streams.append(s)
            if i < 3:  # the holder takes them while the cache saves more than its queue costs
                assert replicas[holder].requests[-1].request_id == f"p{i}"
        assert replicas[1 - holder].requests[0].request_id == "p3"  # then the other replica
        # Once both have the prefix, load alone decides: 4 and 4.
        assert sorted(len(r.requests) for r in replicas) == [4, 4]
        assert router.counters[holder].routed_by_prefix == 3
        for r in replicas:
            r.gate.set()
        for s in streams:
            async for _ in s:
                pass

    asyncio.run(go())


def test_a_continuation_goes_to_the_replica_that_parked_its_sequence(replicas):
    async def go():
        router = router_of(replicas)
        first = router.generate(request("turn1", [4] * 40, keep_alive=True))
        async for _ in first:
            pass
        owner = 0 if replicas[0].requests else 1
        other = replicas[1 - owner]
        # Load the owner so that load alone would pick the other replica.
        replicas[owner].gate.clear()
        busy = [router.generate(request(f"busy{i}", [i + 50] * 3)) for i in range(2)]
        for s in busy:
            s.open()
        before = len(other.requests)
        nxt = router.generate(request("turn2", [4] * 40 + [7, 8, 9, 1, 2], continue_from="turn1"))
        nxt.open()
        assert replicas[owner].requests[-1].request_id == "turn2"
        assert router.counters[owner].routed_by_continuation == 1
        router.release("turn1")
        assert replicas[owner].released == ["turn1"] and other.released == []
        assert len(other.requests) >= before
        replicas[owner].gate.set()
        for s in [*busy, nxt]:
            async for _ in s:
                pass

    asyncio.run(go())


def test_abort_reaches_the_replica_running_the_request(replicas):
    async def go():
        router = router_of(replicas)
        for r in replicas:
            r.gate.clear()
        s = router.generate(request("x", [5] * 30))
        s.open()
        owner = 0 if replicas[0].requests else 1
        router.abort("x")
        assert replicas[owner].aborted == ["x"] and replicas[1 - owner].aborted == []
        for r in replicas:
            r.gate.set()
        async for _ in s:
            pass

    asyncio.run(go())


def test_a_dead_replica_leaves_rotation_and_the_router_fails_only_with_the_last(replicas):
    async def go():
        router = router_of(replicas)
        replicas[1].failure = "the engine process exited (code -9)"
        for i in range(4):
            s = router.generate(request(f"q{i}", [i + 1] * 20))
            assert [d.finish_reason async for d in s] == ["stop"]
        assert len(replicas[0].requests) == 4 and not replicas[1].requests
        assert router.failure is None
        rows = router.replica_stats()
        assert [(i, live) for i, live, _, _ in rows] == [(0, True), (1, False)]
        assert router.stats().tokens_decoded == replicas[0].decoded  # the dead one is not counted
        replicas[0].failure = "the engine process exited (code 1)"
        assert "every engine replica has failed" in router.failure
        with pytest.raises(RuntimeError):
            router.generate(request("late", [1] * 20))

    asyncio.run(go())


def test_a_lost_replicas_counters_stay_in_the_totals_and_its_gauges_leave(replicas):
    async def go():
        router = router_of(replicas)
        for i in range(4):
            s = router.generate(request(f"c{i}", [i + 1] * 20))
            async for _ in s:
                pass
        before = router.stats()
        assert before.tokens_decoded == replicas[0].decoded + replicas[1].decoded > 0
        replicas[1].failure = "the engine process exited (code -9)"
        after = router.stats()
        assert after.tokens_decoded == before.tokens_decoded  # a counter never goes back
        assert after.running == 1 and after.pages_total == 10  # the lost replica's state is gone

    asyncio.run(go())


def test_stats_add_up_over_replicas(replicas):
    router = router_of(replicas)
    total = router.stats()
    assert total.running == 2 and total.pages_total == 20 and total.pages_used == 4


def test_a_running_request_id_is_refused(replicas):
    async def go():
        router = router_of(replicas)
        replicas[0].gate.clear()
        replicas[1].gate.clear()
        s = router.generate(request("same", [1] * 20))
        s.open()
        with pytest.raises(ValueError, match="already running"):
            router.generate(request("same", [2] * 20))
        for r in replicas:
            r.gate.set()
        async for _ in s:
            pass

    asyncio.run(go())
