"""`PrefillGraphRunner`: a step that is not plain decode (a prompt, a chunk, decode rows beside
them), padded to a bucket, computes what the eager step does.

On CPU the runner's buffers are filled exactly as before a replay and the captured function is
run eagerly (`step`); the GPU test replays the captured graphs through the engine.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tests.triton_interpreter  # noqa: F401  (first: sets TRITON_INTERPRET on CPU)
from inference.config import ModelConfig
from inference.model.gpt_oss import GptOssModel
from inference.model.tiny_checkpoint import hf_config_dict
from inference.runner.cuda_graphs import (
    PREFILL_BUCKETS,
    DecodeGraphRunner,
    PrefillGraphRunner,
    step_graph_buckets,
)
from inference.runner.model_runner import build_metadata

PAGE = 16


def tiny_model() -> GptOssModel:
    return GptOssModel.from_random(ModelConfig.from_dict(hf_config_dict()), device="cpu", max_positions=128, seed=3)


def random_caches(config: ModelConfig, pages: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shape = (pages, PAGE, config.num_key_value_heads, config.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(config.num_hidden_layers)]


def exact_lists(runner: PrefillGraphRunner, q_lens: list[int], contexts: list[int], bucket: int):
    """What the reference backend needs to know of a filled bucket: the real sequences, the
    padding sequence (positions 0.. of the rest of the bucket), then sequences with no tokens."""
    pad = bucket - sum(q_lens)
    rest = runner.max_seqs - len(q_lens)
    return q_lens + [pad] + [0] * (rest - 1), contexts + [pad] * rest


# (starts, new tokens) of each sequence; the bucket the step pads to
STEPS = [
    ([0], [5], 16),  # a prompt
    ([20], [9], 16),  # a chunk after a cached prefix
    ([20], [12], 32),
    ([31], [16], 16),  # fills its bucket: no padding
    ([30, 0, 12, 20], [1, 9, 1, 3], 16),  # decode rows beside a prompt and a chunk
    ([40, 7, 0], [1, 1, 20], 32),
]


@pytest.mark.parametrize("starts, q_lens, bucket", STEPS)
def test_padded_step_equals_the_eager_step(starts, q_lens, bucket):
    model = tiny_model()
    tables = [[7, 2, 9, 4], [3, 10], [5, 11], [6, 8]][: len(starts)]  # pages 0, 1 belong to nobody here
    eager_caches = random_caches(model.config, 12)
    padded_caches = copy.deepcopy(eager_caches)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model.config.vocab_size, (s + n,), generator=gen) for s, n in zip(starts, q_lens)]
    cpu = torch.device("cpu")
    with torch.inference_mode():
        for seq_ids, table, start in zip(ids, tables, starts):
            if start:  # the cached prefix, written the same way into both
                prefix = build_metadata(PAGE, [table], [table], [0], [start], cpu)
                model(seq_ids[:start], prefix, eager_caches)
                model(seq_ids[:start], prefix, padded_caches)
        meta = build_metadata(PAGE, tables, tables, starts, q_lens, cpu)
        new_ids = torch.cat([seq_ids[start:] for seq_ids, start in zip(ids, starts)])
        last_rows = torch.tensor(q_lens).cumsum(0) - 1  # each sequence samples from its last token
        eager = model.compute_logits(model(new_ids, meta, eager_caches)[last_rows])

        runner = PrefillGraphRunner(model, padded_caches, max_pages=8, max_context=128, buckets=(16, 32), max_seqs=6)
        buf = runner.buffers(bucket)
        runner.fill(buf, new_ids, meta, last_rows)
        contexts = [s + n for s, n in zip(starts, q_lens)]
        padded = runner.step(buf, exact_lists(runner, q_lens, contexts, bucket))[: len(q_lens)]

    n = sum(q_lens)
    assert buf.context_lens.tolist()[: len(q_lens) + 1] == contexts + [bucket - n]
    assert buf.cu_seqlens_q.tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()] + [bucket] * (6 - len(q_lens))
    assert buf.slots["full"][n:].eq(-1).all() and buf.valid_tokens.tolist() == [n]
    assert buf.positions.tolist() == meta.positions.tolist() + list(range(bucket - n))
    # The leading decode rows, for the Triton backend's decode kernel (the reference ignores them).
    d = next(i for i, k in enumerate(q_lens + [0]) if k != 1)
    prefix = buf.decode_prefix
    assert prefix.rows == min(bucket, 5) and prefix.context_lens.tolist() == contexts[:d] + [0] * (prefix.rows - d)
    assert prefix.cu_seqlens_q.tolist() == [max(c, d) for c in buf.cu_seqlens_q.tolist()]
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    for (ek, ev), (pk, pv) in zip(eager_caches, padded_caches):
        # The real tokens' K/V land where the eager step puts them; the padded ones write nothing.
        torch.testing.assert_close(pk, ek, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pv, ev, rtol=1e-5, atol=1e-5)
        untouched = [p for p in range(12) if not any(p in t for t in tables)]
        assert pk[untouched].equal(ek[untouched]) and pv[untouched].equal(ev[untouched])


def test_fill_leaves_nothing_of_a_longer_earlier_step():
    model = tiny_model()
    runner = PrefillGraphRunner(
        model, random_caches(model.config, 12), max_pages=8, max_context=128, buckets=(16,), max_seqs=4
    )
    buf = runner.buffers(16)
    ids = torch.arange(30)
    cpu = torch.device("cpu")
    runner.fill(
        buf,
        ids[:14],
        build_metadata(PAGE, [[4], [9], [3, 5]], [[4], [9], [3, 5]], [5, 9, 0], [1, 1, 12], cpu),
        torch.tensor([0, 1, 13]),
    )
    assert buf.decode_prefix.context_lens.tolist()[:3] == [6, 10, 0]
    assert buf.decode_prefix.cu_seqlens_q.tolist() == [2, 2, 2, 14, 16]
    runner.fill(buf, ids[:4], build_metadata(PAGE, [[1, 2, 6]], [[1, 2, 6]], [40], [4], cpu), torch.tensor([3]))
    assert buf.input_ids.tolist() == [0, 1, 2, 3] + [0] * 12
    assert buf.slots["sliding"].tolist() == [6 * PAGE + 8 + i for i in range(4)] + [-1] * 12
    # (a step where a prompt joins has its table padded to whole 16s with -1: `table_width`)
    assert buf.block_tables["full"][0, :4].tolist() == [1, 2, 6, -1] and buf.row.tolist()[0] == 3
    assert buf.block_tables["full"][1].eq(0).all()  # the padding sequence's row: page 0
    assert buf.positions.tolist() == [40, 41, 42, 43] + list(range(12))
    assert buf.context_lens.tolist() == [44, 12, 12, 12] and buf.cu_seqlens_q.tolist() == [0, 4, 16, 16, 16]
    assert buf.decode_prefix.context_lens.eq(0).all()  # a prompt first: no decode rows
    assert buf.decode_prefix.cu_seqlens_q.tolist() == [0, 4, 16, 16, 16]
    assert not runner.can_run(4)  # nothing captured
    runner.graphs[16] = buf
    # Up to 3 sequences (one slot holds the padding), 16 tokens, 16 rows.
    assert runner.can_run(16, 3, 3) and runner.can_run(1, 1, 1)
    assert not runner.can_run(16, 4, 1) and not runner.can_run(17, 1, 1)


def test_step_graphs_hold_a_capped_chunk_beside_the_decode_rows():
    # A row for each of 256 sequences beside a 1,024-token chunk: 1,280 tokens.
    assert step_graph_buckets(256, 1024) == (*PREFILL_BUCKETS, 1152, 1280)
    assert step_graph_buckets(64, 1024) == (*PREFILL_BUCKETS, 1152)  # 1,088
    assert step_graph_buckets(32, 512) == PREFILL_BUCKETS  # fits the defaults
    assert step_graph_buckets(512, 1536)[-3:] == (1536, 1664, 1792)  # 256 rows: 1,792
    # Uncapped, a joining prompt may take the whole token budget: such steps stay eager.
    assert step_graph_buckets(256, None) == PREFILL_BUCKETS
    assert step_graph_buckets(256, 8192)[-1] == 2048  # bounded


def test_decode_graphs_cover_the_configured_batch():
    def sizes(max_batch):
        return DecodeGraphRunner(None, [], max_pages=8, max_context=128, max_batch=max_batch).batch_sizes

    assert sizes(256)[-1] == 256 and sizes(300)[-1] == 320 and sizes(512)[-1] == 512
    assert sizes(5)[-1] == 8 and sizes(4096)[-1] == 512  # past the largest size, the rest runs eagerly


def eager_against_graphs(drive, **options):
    """`drive(engine)` -> per request (tokens, logprobs, top-2 margins), on the float32 tiny model
    eagerly and with graphs: ({eager: its result}, the q_lens of each step graph replayed)."""
    from inference.engine.core import LLMEngine

    config = ModelConfig.from_dict(hf_config_dict())
    runs, replays = {}, []
    for eager in (True, False):
        engine = LLMEngine.from_random(
            config, device="cuda", dtype=torch.float32, seed=3, enforce_eager=eager, **{"num_pages": 256, **options}
        )
        assert (engine.runner.prefill_graphs is None) == eager
        if not eager:

            def recording(ids, meta, rows, run=engine.runner.prefill_graphs.run):
                replays.append(meta.q_lens)
                return run(ids, meta, rows)

            engine.runner.prefill_graphs.run = recording
        runs[eager] = drive(engine)
    return runs, replays


def assert_first_tokens_agree(runs) -> None:
    """The first token of each request, the prefill's own: its logprob agrees wherever the choice does."""
    for (tokens_e, logprobs_e, _), (tokens_g, logprobs_g, _) in zip(runs[True], runs[False]):
        if tokens_e[0] == tokens_g[0]:
            assert abs(logprobs_e[0] - logprobs_g[0]) < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [8, 8192])
def test_engine_short_prefills_replay_the_graphs_and_match_eager(chunk):
    """float32 tiny model through the engine, eager against graphs; greedy tokens equal up to each
    sequence's first near tie. Chunks of 8 tokens keep MoE on its per-token GEMV path in both (8
    real tokens, 16 in the graph), and every chunk after the first prefills after cached ones
    (cuBLAS may still pick another float32 kernel for 16 rows than for 8: ties of 0.01). Whole
    prompts (150 to 171 tokens: 256 in the graph) take the grouped path, whose float32 dots run
    as TF32 on tensor cores and round differently at another token count: ties of 0.05."""
    from tests.gpu_comparison import compare_greedy, greedy, prompts

    # One request at a time, so each prefill step holds one sequence.
    runs, replays = eager_against_graphs(
        lambda engine: [greedy(engine, [p], 12)[0] for p in prompts(4, 150)], max_num_batched_tokens=chunk
    )
    assert replays and all(len(q) == 1 and q[0] <= (8 if chunk == 8 else 171) for q in replays)
    compared, total = compare_greedy(runs[True], runs[False], near_tie=0.01 if chunk == 8 else 0.05)
    # The random tiny model is full of near ties: whole prompts compared 15 of 48 tokens at 0.05
    # (H200, 2026-11-24), all equal.
    assert compared >= total // (2 if chunk == 8 else 4), f"only {compared} of {total} tokens were compared"
    assert_first_tokens_agree(runs)


@pytest.mark.gpu
def test_engine_requests_joining_a_batch_replay_step_graphs_and_match_eager():
    """float32 tiny model through the engine, eager against graphs, requests joining one by one
    while the others decode: their prompts prefill beside decode rows, in one step graph each
    (several sequences, some of one token). Greedy tokens equal up to each sequence's first near
    tie; prompts of 40 to 61 tokens beside up to 3 decode rows pad to 64 (grouped MoE path, TF32
    dots: ties of 0.05, as for whole prompts above)."""
    from inference.request import GenerationRequest, SamplingParams
    from tests.gpu_comparison import compare_greedy, generations, prompts

    def drive(engine):
        waiting, deltas, step = list(enumerate(prompts(4, 40))), {}, 0
        while waiting or engine.has_unfinished():
            if waiting and step % 3 == 0:  # one joins every third step
                i, prompt = waiting.pop(0)
                engine.add_request(
                    GenerationRequest(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=2))
                )
            for d in engine.step():
                deltas.setdefault(d.request_id, []).append(d)
            step += 1
        return generations(deltas, 4)

    runs, replays = eager_against_graphs(drive)
    joined = [q for q in replays if len(q) > 1 and 1 in q and max(q) > 1]
    assert len(joined) == 3, f"steps replayed: {replays}"  # requests 1, 2 and 3 joined running ones
    compared, total = compare_greedy(runs[True], runs[False], near_tie=0.05)
    assert compared >= total // 4, f"only {compared} of {total} tokens were compared"
    assert_first_tokens_agree(runs)


@pytest.mark.gpu
def test_engine_step_graphs_take_a_capped_chunk_beside_64_decoding_sequences():
    """A 1,000-token prompt joining 64 decoding sequences (1,064 tokens, past the 1,024 bucket)
    replays the step graph of 1,152 tokens (the buckets go on to 1,280: a row for each of 256
    sequences beside a 1,024-token chunk), and its steps equal the eager engine's."""
    from inference.request import GenerationRequest, SamplingParams
    from tests.gpu_comparison import compare_greedy, generations, prompts

    def drive(engine):
        if engine.runner.prefill_graphs is not None:  # (the eager run has none)
            assert engine.runner.prefill_graphs.buckets[-2:] == (1152, 1280)
        many = [prompts(1, 8, seed=i)[0] for i in range(64)] + prompts(1, 1000, seed=64)
        for i, prompt in enumerate(many[:64]):
            engine.add_request(
                GenerationRequest(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))
            )
        deltas, step = {}, 0
        while engine.has_unfinished():
            if step == 2:  # the 64 decode; the long prompt joins them
                engine.add_request(
                    GenerationRequest("64", many[64], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))
                )
            for d in engine.step():
                deltas.setdefault(d.request_id, []).append(d)
            step += 1
        return generations(deltas, 65)

    runs, replays = eager_against_graphs(drive, max_prefill_tokens_decoding=1024, num_pages=1024)
    assert any(sum(q) > 1024 and len(q) == 65 for q in replays), f"steps replayed: {[sum(q) for q in replays]}"
    compared, total = compare_greedy(runs[True], runs[False], near_tie=0.05)
    assert compared >= total // 4, f"only {compared} of {total} tokens were compared"
