"""Async scheduling (`inference/scheduling/async_scheduling.py`) and the packed step inputs it relies on.

The oracle is the synchronous engine on the same tiny random model: with async scheduling on,
every request must get exactly the same tokens (greedy, and seeded sampling), the same finish
reasons and logprobs, whatever the workload does: requests of different lengths arriving at
different steps, chunked prefill beside decodes, prefix-cache hits, stop tokens and max_tokens
hit mid-batch, aborts, penalties (which fall back to synchronous steps), continuations. Each run
also checks that steps really were launched ahead (`in_flight`) and that every page comes back.
The packed inputs are checked against `build_metadata`, the plain definition.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from inference.config import EngineConfig
from inference.engine.async_engine import AsyncEngine
from inference.engine.core import LLMEngine
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import write_tiny_checkpoint
from inference.request import GenerationRequest, SamplingParams
from inference.runner.model_runner import build_metadata
from inference.runner.step_inputs import StepInputPacker
from inference.scheduling.scheduler import SequenceStatus
from tests.engine_runs import random_prompt as prompt


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-async-scheduling"), seed=0)
    return GptOssModel.from_pretrained(path, device="cpu")


def engine(model, async_scheduling: bool, **options) -> LLMEngine:
    options = {"page_size": 4, "num_pages": 256, "max_num_batched_tokens": 16, **options}
    return LLMEngine(model, EngineConfig(async_scheduling=async_scheduling, **options))


class Run:
    """An engine driven one `step()` per call: `arrivals[k]` are added and `aborts[k]` aborted
    just before call k. Records each request's deltas, how many calls left a step in flight, and
    which requests ended while the step after theirs was already queued (a surplus row)."""

    def __init__(
        self, eng: LLMEngine, arrivals: dict[int, list[GenerationRequest]], aborts: dict[int, list[str]] | None = None
    ):
        self.engine = eng
        self.deltas: dict[str, list] = {}
        self.calls_in_flight = 0
        self.ended_with_next_queued: set[str] = set()
        aborts = aborts or {}
        last = max([*arrivals, *aborts])
        call = 0
        while eng.has_unfinished() or call <= last:
            for request in arrivals.get(call, []):
                eng.add_request(request)
            for rid in aborts.get(call, []):
                delta = eng.abort(rid)
                if delta is not None:
                    self.deltas.setdefault(rid, []).append(delta)
            for delta in eng.step():
                self.deltas.setdefault(delta.request_id, []).append(delta)
                if delta.finish_reason is not None and eng.in_flight:
                    self.ended_with_next_queued.add(delta.request_id)
            self.calls_in_flight += eng.in_flight
            call += 1
            assert call < 1000

    def tokens(self) -> dict[str, list[int]]:
        return {rid: [t for d in ds for t in d.token_ids] for rid, ds in self.deltas.items()}

    def finishes(self) -> dict[str, tuple]:
        return {rid: (ds[-1].finish_reason, ds[-1].stop_token_id) for rid, ds in self.deltas.items()}

    def logprobs(self) -> dict[str, list]:
        return {
            rid: [(lp.token_id, lp.logprob, lp.top) for d in ds for lp in (d.logprobs or [])]
            for rid, ds in self.deltas.items()
        }


def assert_back_to_baseline(eng: LLMEngine) -> None:
    for rid in list(eng.scheduler.parked):
        eng.release(rid)
    assert not eng.has_unfinished() and not eng.in_flight
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.scheduler.parked
    assert eng.cache.full.num_used == 0 and eng.cache.sliding.num_used == 0
    assert all(r == 0 for r in eng.cache.full.refcount + eng.cache.sliding.refcount)


def request(rid: str, ids: list[int], **sampling) -> GenerationRequest:
    return GenerationRequest(rid, list(ids), SamplingParams(**sampling))


def mixed_workload(sampling: dict, stops: dict[str, int] | None = None) -> dict[int, list[GenerationRequest]]:
    """Requests of different lengths arriving at different calls: long prompts prefill in chunks
    beside decodes (16-token budget), "p2" shares "p1"'s first 24 tokens (a prefix-cache hit),
    "pen" carries a penalty (synchronous steps while it runs), "lp" asks for logprobs."""
    stops = stops or {}
    shared = prompt(50, 24)

    def r(rid, ids, max_tokens, **extra):
        return request(
            rid,
            ids,
            max_tokens=max_tokens,
            stop_token_ids=[stops[rid]] if rid in stops else [],
            **{**sampling, **extra},
        )

    return {
        0: [r("a", prompt(1, 5), 14), r("b", prompt(2, 21), 9), r("p1", shared + prompt(3, 3), 8)],
        3: [r("c", prompt(4, 9), 16, logprobs=3)],
        4: [r("pen", prompt(5, 6), 4, frequency_penalty=-2.0)],
        9: [r("d", prompt(6, 33), 7), r("e", prompt(7, 3), 12), r("p2", shared + prompt(8, 5), 10)],
        15: [r("lp", prompt(9, 7), 9, logprobs=0)],
    }


def sampling_cases():
    return [
        pytest.param(dict(temperature=0.0), id="greedy"),
        pytest.param(dict(temperature=0.9, top_k=50), id="seeded"),
    ]


def with_seeds(arrivals, sampling):
    if sampling["temperature"] > 0:
        for k, requests in arrivals.items():
            for i, req in enumerate(requests):
                req.sampling.seed = 1000 + 10 * k + i
    return arrivals


@pytest.mark.parametrize("sampling", sampling_cases())
def test_async_scheduling_gives_the_synchronous_tokens(model, sampling):
    plain = Run(engine(model, False), with_seeds(mixed_workload(sampling), sampling))
    # Stop tokens picked from the plain run's own output, so they end requests mid-batch.
    stops = {rid: plain.tokens()[rid][k] for rid, k in (("a", 6), ("c", 9), ("e", 2), ("p2", 4))}
    sync = Run(engine(model, False), with_seeds(mixed_workload(sampling, stops), sampling))
    overlapped = Run(engine(model, True), with_seeds(mixed_workload(sampling, stops), sampling))

    assert overlapped.tokens() == sync.tokens()
    assert overlapped.finishes() == sync.finishes()
    assert sync.finishes()["a"] == ("stop", stops["a"]) and sync.finishes()["d"] == ("length", None)
    for rid in ("c", "lp"):
        got, want = overlapped.logprobs()[rid], sync.logprobs()[rid]
        assert [(t, [i for i, _ in top]) for t, _, top in got] == [(t, [i for i, _ in top]) for t, _, top in want]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-5)
        assert len(got) == len(sync.tokens()[rid])
    # The overlap really ran (the steady decode steps; prefill chunks and arrivals are
    # synchronous), stop tokens came while the next step was queued, and nothing was left behind.
    assert overlapped.calls_in_flight >= 8 and sync.calls_in_flight == 0
    assert {rid for rid in overlapped.ended_with_next_queued if overlapped.finishes()[rid][0] == "stop"}
    assert overlapped.engine.stats().prefix_hit_tokens >= 24
    stats, want = overlapped.engine.stats(), sync.engine.stats()
    assert (stats.tokens_decoded, stats.tokens_prefilled) == (want.tokens_decoded, want.tokens_prefilled)
    assert_back_to_baseline(overlapped.engine)


@pytest.mark.parametrize("sampling", sampling_cases())
def test_aborts_mid_generation(model, sampling):
    def arrivals():
        reqs = {
            0: [request(rid, prompt(20 + i, 4 + 3 * i), max_tokens=20, **sampling) for i, rid in enumerate("abcde")]
        }
        return with_seeds(reqs, sampling)

    # b, d and e are aborted while decoding, with a step in flight on the overlapped engine.
    aborts = {5: ["b"], 8: ["d", "e"]}
    sync = Run(engine(model, False), arrivals(), aborts)
    overlapped = Run(engine(model, True), arrivals(), aborts)
    assert overlapped.tokens() == sync.tokens()
    assert overlapped.finishes() == sync.finishes()
    assert sync.finishes()["b"][0] == "abort" and 0 < len(sync.tokens()["b"]) < 20
    assert overlapped.calls_in_flight >= 10
    assert_back_to_baseline(overlapped.engine)


def test_penalties_run_synchronously_and_give_the_same_tokens(model):
    """A penalised request needs its latest token on the host before the next step samples, so
    batches holding it never overlap; once it is done the others do."""

    def arrivals():
        return {
            0: [
                request("pen", prompt(40, 5), temperature=0.0, max_tokens=12, frequency_penalty=-2.0),
                request("plain", prompt(41, 7), temperature=0.0, max_tokens=24),
            ]
        }

    sync = Run(engine(model, False), arrivals())
    overlapped = Run(engine(model, True), arrivals())
    assert overlapped.tokens() == sync.tokens()
    assert 0 < overlapped.calls_in_flight <= 24 - 12
    assert_back_to_baseline(overlapped.engine)


def test_stop_while_the_next_step_is_queued_parks_the_same_pages(model):
    """A keep_alive request that stops at step N already has step N+1 queued (with a page
    reserved one position further); it must park exactly what the synchronous engine parks, and
    its continuation must generate the same tokens."""
    ids = prompt(60, 11)
    probe = Run(engine(model, False), {0: [request("x", ids, temperature=0.0, max_tokens=12)]})
    stop = probe.tokens()["x"][5]  # its K/V would sit at position 11 + 5 = 16: a page of its own

    def arrivals():
        return {
            0: [
                GenerationRequest(
                    "x", ids, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]), keep_alive=True
                ),
                request("other", prompt(61, 5), temperature=0.0, max_tokens=12),
            ]
        }

    runs = [Run(engine(model, flag), arrivals()) for flag in (False, True)]
    assert runs[0].tokens() == runs[1].tokens() and runs[1].finishes()["x"] == ("stop", stop)
    parked = [r.engine.scheduler.parked["x"] for r in runs]
    assert parked[0].num_computed == 16 == parked[1].num_computed
    assert len(parked[1].pages.full) == len(parked[0].pages.full) == 4
    assert runs[1].engine.cache_usage() == runs[0].engine.cache_usage()
    follow = ids + runs[0].tokens()["x"] + prompt(62, 3)
    again = [
        Run(
            r.engine,
            {0: [GenerationRequest("x2", follow, SamplingParams(temperature=0.0, max_tokens=6), continue_from="x")]},
        )
        for r in runs
    ]
    assert again[1].tokens()["x2"] == again[0].tokens()["x2"] and len(again[0].tokens()["x2"]) == 6
    assert runs[1].calls_in_flight > 0 and again[1].calls_in_flight > 0
    assert "x" in runs[1].ended_with_next_queued  # x's surplus row ran, and its reserved page was trimmed
    for r in runs:
        assert_back_to_baseline(r.engine)


def test_when_the_next_step_is_launched_ahead(model):
    eng = engine(model, True, max_num_seqs=2, max_model_len=64)
    overlap = eng.overlap
    eng.add_request(request("a", prompt(70, 6), temperature=0.0, max_tokens=8))
    eng.add_request(request("b", prompt(71, 5), temperature=0.0, max_tokens=2))
    eng.overlap = None
    eng.step()  # both prefill, synchronously here: nothing left in flight
    eng.overlap = overlap
    assert not eng.in_flight
    decode = eng.scheduler.schedule()  # from here on the steps are planned by hand
    assert decode.num_new == [1, 1]
    a, b = decode.seqs
    pages_before = list(a.pages.full)
    nxt = overlap.next_batch(decode)
    # b's next token is its last (max_tokens 2): it is left out; a decodes one position further,
    # its pages reserved for that position now.
    assert nxt.seqs == [a] and nxt.num_new == [1]
    assert len(a.pages.full) * 4 >= a.num_computed + 2 and a.pages.full[: len(pages_before)] == pages_before
    # A waiting request with no room (max_num_seqs 2) waits; with room it joins the step
    # planned ahead, behind the row that decodes the launched step's sample.
    eng.add_request(request("c", prompt(72, 4), temperature=0.0, max_tokens=3))
    assert overlap.next_batch(decode).seqs == [a]
    eng.scheduler.finish(b)
    nxt = overlap.next_batch(decode)
    c = eng.scheduler.find("c")
    assert nxt.seqs == [a, c] and nxt.num_new == [1, 4] and nxt.prefill_tokens == 4
    assert c.status == SequenceStatus.RUNNING and c.num_computed == 0
    eng.abort("c")
    # Penalties need the host's token history: no overlap for a batch holding one.
    a.sampling.presence_penalty = 0.5
    assert overlap.next_batch(decode) is None


def test_requests_joining_the_batch_and_later_chunks_are_planned_ahead(model):
    """A request arriving while a step is in flight joins the step planned ahead of that step's
    tokens, beside the rows that decode its samples (taken on the device), and a long prompt's
    later chunks are planned ahead too: after the first step every step is launched before the
    previous one's tokens are read, and the tokens are those of the synchronous engine."""
    eng = engine(model, True)  # 16-token budget
    out: dict[str, list[int]] = {}

    def step() -> list[int]:
        for delta in eng.step():
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
        batch = eng._inflight.batch
        return [s.request_id for s in batch.seqs], batch.num_new, batch.prefill_tokens

    eng.add_request(request("a", prompt(80, 6), temperature=0.0, max_tokens=12))
    assert step() == (["a"], [1], 0)  # a's prompt ran synchronously; its first decode step is queued
    eng.add_request(request("b", prompt(81, 9), temperature=0.0, max_tokens=6))
    assert step() == (["a", "b"], [1, 9], 9)  # b joins the step planned ahead
    assert step() == (["a", "b"], [1, 1], 0)  # b's prompt ends there: it decodes its sample next
    eng.add_request(request("c", prompt(82, 30), temperature=0.0, max_tokens=4))
    assert step() == (["a", "b", "c"], [1, 1, 14], 14)
    assert step() == (["a", "b", "c"], [1, 1, 14], 14)  # c's next chunk, planned before the first is read
    assert step() == (["a", "b", "c"], [1, 1, 2], 2)
    assert step() == (["a", "b", "c"], [1, 1, 1], 0)
    while eng.has_unfinished():
        for delta in eng.step():
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
    times = eng.stats().step_times
    assert times.sync_steps == 1 and times.mixed_steps == 4 and times.mixed_prefill_tokens == 39
    sync = Run(
        engine(model, False),
        {
            0: [request("a", prompt(80, 6), temperature=0.0, max_tokens=12)],
            1: [request("b", prompt(81, 9), temperature=0.0, max_tokens=6)],
            3: [request("c", prompt(82, 30), temperature=0.0, max_tokens=4)],
        },
    )
    assert out == sync.tokens() and {len(v) for v in out.values()} == {12, 6, 4}
    assert_back_to_baseline(eng)


def test_a_lone_prompts_chunks_are_planned_ahead(model, caplog):
    """A prompt longer than the step budget with nothing decoding beside it: its chunk steps
    sample nothing, and the chunk after each is still launched ahead (it once failed there,
    logged a traceback and ran synchronously)."""
    eng = engine(model, True)  # 16-token budget
    eng.add_request(request("long", prompt(83, 50), temperature=0.0, max_tokens=5))
    out: list[int] = []
    with caplog.at_level(logging.WARNING, logger="inference.engine.core"):
        caplog.clear()
        while eng.has_unfinished():
            for delta in eng.step():
                out.extend(delta.token_ids)
    assert not caplog.records
    assert eng.stats().step_times.sync_steps == 1
    sync = Run(engine(model, False), {0: [request("long", prompt(83, 50), temperature=0.0, max_tokens=5)]})
    assert out == sync.tokens()["long"] and len(out) == 5
    assert_back_to_baseline(eng)


def test_async_scheduling_is_off_on_cpu_unless_asked(model):
    assert LLMEngine(model, EngineConfig(page_size=4, num_pages=64)).overlap is None
    assert LLMEngine(model, EngineConfig(page_size=4, num_pages=64, async_scheduling=True)).overlap is not None
    spec = LLMEngine(model, EngineConfig(page_size=4, num_pages=64, async_scheduling=True, speculative="ngram"))
    assert spec.overlap is None  # drafts are verified synchronously
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes").validate()


def test_serve_flag_sets_async_scheduling():
    from agent_server.cli.main import build_parser
    from agent_server.cli.serve import engine_options

    def options(*argv):
        return engine_options(build_parser().parse_args(["serve", *argv]))

    assert "async_scheduling" not in options()
    assert options("--async-scheduling")["async_scheduling"] is True
    assert options("--no-async-scheduling")["async_scheduling"] is False


async def test_async_engine_thread_with_async_scheduling(model):
    prompts = [prompt(80 + i, 4 + 6 * i) for i in range(4)]
    sync = Run(
        engine(model, False), {0: [request(str(i), p, temperature=0.0, max_tokens=10) for i, p in enumerate(prompts)]}
    )
    eng = AsyncEngine(engine(model, True))
    try:

        async def collect(i, p):
            return [d async for d in eng.generate(request(str(i), p, temperature=0.0, max_tokens=10))]

        results = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)))
        await eng.wait_idle()
        for i, deltas in enumerate(results):
            assert [t for d in deltas for t in d.token_ids] == sync.tokens()[str(i)]
            assert deltas[-1].finish_reason == "length"
        assert eng.stats().pages_used == 0 and eng.stats().running == 0
    finally:
        await eng.shutdown()


@pytest.mark.gpu
def test_gpu_async_scheduling_gives_the_synchronous_tokens(tmp_path):
    """The CUDA path: pinned staging buffers, one non-blocking input copy, ids read back by event
    while the next CUDA-graph step runs. float32 tiny model; compared up to each sequence's first
    near tie (batch composition differs by the surplus rows, which may round differently)."""
    from tests.gpu_comparison import compare_greedy
    from tests.gpu_comparison import prompts as gpu_prompts

    path = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    model = GptOssModel.from_pretrained(path, device="cuda", dtype=torch.float32)
    batch = gpu_prompts(6, 150)
    stops = {}

    def run(flag: bool):
        eng = LLMEngine(model, EngineConfig(num_pages=512, page_size=16, async_scheduling=flag))
        assert eng.runner.graphs is not None
        arrivals = {0: [], 5: []}
        for i, p in enumerate(batch):
            sampling = SamplingParams(
                temperature=0.0,
                max_tokens=30 + 3 * i,
                logprobs=2,
                stop_token_ids=[stops[str(i)]] if str(i) in stops else [],
            )
            arrivals[0 if i < 4 else 5].append(GenerationRequest(str(i), p, sampling))
        r = Run(eng, arrivals)
        assert_back_to_baseline(eng)
        return r

    plain = run(False)
    stops.update({rid: plain.tokens()[rid][12] for rid in ("1", "4")})
    sync, overlapped = run(False), run(True)
    assert overlapped.calls_in_flight >= 20
    same = [rid for rid in sync.tokens() if overlapped.tokens()[rid] == sync.tokens()[rid]]
    assert all(overlapped.finishes()[rid] == sync.finishes()[rid] for rid in same)
    assert {"1", "4"} & set(same) and all(sync.finishes()[rid][0] == "stop" for rid in ("1", "4"))

    def greedy_view(r):
        return [
            (r.tokens()[str(i)], [], [lp.top[0][1] - lp.top[1][1] for d in r.deltas[str(i)] for lp in d.logprobs or []])
            for i in range(len(batch))
        ]

    # Surplus rows change the batch shapes the GPU kernels see, so float32 rounding differs a
    # little (as between the GPU and the CPU reference: tests/inference/engine/test_gpu_engine.py, same tolerance).
    compared, total = compare_greedy(greedy_view(sync), greedy_view(overlapped), near_tie=0.01)
    assert compared >= total // 2, f"only {compared} of {total} tokens were clear enough to compare"


@pytest.mark.gpu
def test_gpu_steady_decode_never_waits_for_the_stream_but_to_read_ids(tmp_path, monkeypatch):
    """With async scheduling, the only wait per decode step must be for that step's own sampled
    ids (`HostCopy.get`): any other synchronising call (a blocking copy, `.item()`, `.tolist()`
    of a device tensor) would also wait for the step queued behind it, and the overlap is gone.
    torch's sync debug mode turns every such call into an error. The same holds for a request
    joining the running ones: its prompt's step is planned and launched ahead too."""
    from inference import transfers

    path = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    model = GptOssModel.from_pretrained(path, device="cuda")
    eng = LLMEngine(model, EngineConfig(num_pages=256, page_size=16, async_scheduling=True))
    for i in range(3):
        sampling = dict(temperature=0.0) if i < 2 else dict(temperature=0.8, seed=5, logprobs=2)
        eng.add_request(request(str(i), prompt(90 + i, 20 + 9 * i), max_tokens=40, **sampling))
    while not eng.in_flight:  # prefill (synchronous), then the first steady decode step
        eng.step()
    real_get = transfers.HostCopy.get

    def get_allowing_its_own_wait(self):
        mode = torch.cuda.get_sync_debug_mode()  # restore what was set: the mode must not leak
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_get(self)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(transfers.HostCopy, "get", get_allowing_its_own_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            assert eng.in_flight
            eng.step()
        eng.add_request(request("joins", prompt(99, 40), max_tokens=6, temperature=0.0))
        for _ in range(6):
            assert eng.in_flight
            eng.step()
        assert eng.scheduler.find("joins").num_output_tokens >= 3
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while eng.has_unfinished():
        eng.step()
    assert_back_to_baseline(eng)


# --- the packed step inputs -------------------------------------------------------------------


def metadata_fields(meta) -> dict:
    return {
        "cu_seqlens_q": meta.cu_seqlens_q,
        "context_lens": meta.context_lens,
        "positions": meta.positions,
        **{f"table_{k}": v for k, v in meta.block_tables.items()},
        **{f"slots_{k}": v for k, v in meta.slot_mapping.items()},
    }


@pytest.mark.parametrize("case", ["decode", "mixed", "no_sliding"])
def test_packed_inputs_equal_build_metadata(case):
    ps = 4
    if case == "decode":
        full, sliding = [[7, 3, 9], [2], [5, 6]], [[-1, 3, 9], [2], [-1, 6]]
        starts, q_lens = [10, 2, 5], [1, 1, 1]
    else:  # a prefill chunk, a decode and an extend, over tables of different widths
        full, sliding = [[1, 2, 3, 4], [8], [11, 12, 13]], [[-1, -1, 3, 4], [8], [-1, 12, 13]]
        starts, q_lens = [9, 1, 6], [6, 1, 4]
        if case == "no_sliding":
            sliding = None
    t = sum(q_lens)
    ids = [100 + i for i in range(t)]
    rows = [q_lens[0] - 1, q_lens[0], t - 1] if case != "decode" else [0, 1, 2]
    want = build_metadata(ps, full, sliding, starts, q_lens, torch.device("cpu"))
    # A step where prompts join pads its tables to whole 16s (`table_width`); decode keeps 3.
    assert want.block_tables["full"].shape[1] == (3 if case == "decode" else 16)
    packer = StepInputPacker(ps, torch.device("cpu"))
    for _ in range(3):  # the host buffers are reused in turn: every round must come out whole
        got = packer.pack(ids, full, sliding, starts, q_lens, rows)
        for name, tensor in metadata_fields(want).items():
            value = metadata_fields(got.meta)[name]
            assert value.dtype == tensor.dtype and torch.equal(value, tensor), name
            assert value.data_ptr() % 16 == 0, name  # as aligned as a tensor of its own (vector loads)
        assert got.input_ids.tolist() == ids and got.input_ids.dtype == torch.int64
        assert got.sample_rows.tolist() == rows and got.sample_rows.dtype == torch.int64
        assert (got.meta.max_q_len, got.meta.q_lens, got.meta.context_lens_list) == (
            want.max_q_len,
            want.q_lens,
            want.context_lens_list,
        )
    # What one step got does not change when the next steps are packed (no view into the buffer).
    first = packer.pack(ids, full, sliding, starts, q_lens, rows)
    snapshot = {k: v.clone() for k, v in metadata_fields(first.meta).items()}
    for _ in range(2):
        packer.pack(
            [0] * t,
            [[0] * len(x) for x in full],
            sliding and [[0] * len(x) for x in sliding],
            [s + 1 for s in starts],
            q_lens,
            rows,
        )
    assert all(torch.equal(metadata_fields(first.meta)[k], v) for k, v in snapshot.items())
