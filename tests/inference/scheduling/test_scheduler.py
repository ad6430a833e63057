"""The scheduler alone, with a fake model step: budgets, chunking, admission, preemption."""

from __future__ import annotations

from inference.request import SamplingParams
from inference.scheduling.kv_cache import KVCacheManager
from inference.scheduling.scheduler import Scheduler, Sequence, SequenceStatus


def make(num_pages=64, page_size=4, window=8, max_num_seqs=8, budget=32, sliding_pages=None, prefill_cap=None):
    cache = KVCacheManager(num_pages, sliding_pages or num_pages, page_size, window)
    return Scheduler(cache, max_num_seqs, budget, prefill_cap)


def seq(rid: str, prompt_len: int, max_tokens: int = 4, start: int = 1000, **kw) -> Sequence:
    ids = list(range(start, start + prompt_len))
    return Sequence(rid, ids, prompt_len, SamplingParams(max_tokens=max_tokens), **kw)


def apply_fake(s: Scheduler, batch) -> None:
    """Pretend the model ran `batch` (planned now or earlier): advance, publish pages, sample
    token 7, finish at max_tokens; sequences no longer running are skipped."""
    for q, n in zip(batch.seqs, batch.num_new):
        if q.status != SequenceStatus.RUNNING:
            continue
        q.num_computed += n
        s.cache.register_computed(q.pages, q.token_ids, q.num_computed)
        if q.num_computed == q.num_tokens:
            q.token_ids.append(7)
            if q.num_output_tokens >= q.sampling.max_tokens:
                s.finish(q)


def steps(batch) -> list[tuple[str, int]]:
    return [(q.request_id, n) for q, n in zip(batch.seqs, batch.num_new)]


def fake_step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the model ran (`apply_fake`)."""
    batch = s.schedule()
    apply_fake(s, batch)
    return steps(batch)


def test_chunked_prefill_shares_the_budget_with_decodes():
    s = make(budget=16)
    s.add(seq("a", 3, max_tokens=10))
    assert fake_step(s) == [("a", 3)]
    s.add(seq("b", 40))
    # a decodes (1 token), b prefills in chunks of what is left of the 16-token budget.
    assert fake_step(s) == [("a", 1), ("b", 15)]
    assert fake_step(s) == [("a", 1), ("b", 15)]
    assert fake_step(s) == [("a", 1), ("b", 10)]
    assert fake_step(s) == [("a", 1), ("b", 1)]  # b's prompt is done: both decode


def test_prefill_is_capped_while_sequences_decode_and_not_when_idle():
    s = make(budget=32, num_pages=128, sliding_pages=128, prefill_cap=6)
    s.add(seq("a", 20, max_tokens=30))
    assert fake_step(s) == [("a", 20)]  # nothing decodes: the whole budget
    s.add(seq("b", 14, start=2000))
    s.add(seq("c", 5, start=3000))
    # a decodes: b and c share 6 prefill tokens a step, b's chunks first (it is running).
    assert fake_step(s) == [("a", 1), ("b", 6)]
    assert fake_step(s) == [("a", 1), ("b", 6)]
    assert fake_step(s) == [("a", 1), ("b", 2), ("c", 4)]
    assert fake_step(s) == [("a", 1), ("b", 1), ("c", 1)]  # b decodes now; c's last prompt token
    assert fake_step(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_without_a_cap_prefill_takes_what_the_decodes_leave():
    s = make(budget=32, num_pages=128, sliding_pages=128)
    s.add(seq("a", 20, max_tokens=30))
    fake_step(s)
    s.add(seq("b", 40, start=2000))
    assert fake_step(s) == [("a", 1), ("b", 31)]


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add(seq(rid, 2))
    assert [r for r, _ in fake_step(s)] == ["a", "b"]
    assert len(s.running) == 2 and s.waiting[0].request_id == "c"


def test_admission_waits_for_free_pages():
    s = make(num_pages=6, sliding_pages=6, budget=64)  # 24 token slots
    s.add(seq("a", 16, max_tokens=3))
    s.add(seq("b", 12, max_tokens=3))
    assert fake_step(s) == [("a", 16)]  # b's 3 pages do not fit next to a's 4 (+1 to come)
    assert s.waiting[0].pages.full == []  # a waiting sequence holds no pages
    while s.running:
        fake_step(s)
    assert [r for r, _ in fake_step(s)] == ["b"]


def test_preemption_frees_the_newest_and_recomputes_later():
    s = make(num_pages=5, sliding_pages=5, budget=64)  # 20 token slots
    a, b = seq("a", 8, max_tokens=8), seq("b", 8, max_tokens=8)
    s.add(a)
    s.add(b)
    assert fake_step(s) == [("a", 8), ("b", 8)]  # 4 pages in use
    assert fake_step(s) == [("a", 1)]  # both need a third page, only one is free: b gives way
    assert s.counters.preemptions == 1
    assert s.waiting[0] is b and b.status == SequenceStatus.WAITING
    assert b.num_computed == 0 and not b.pages.holds_pages
    assert b.num_output_tokens == 1  # its generated token is kept
    # Readmitted next step: its prompt's two full pages are still cached, so only the generated
    # token is recomputed.
    assert fake_step(s) == [("a", 1), ("b", 1)]
    assert b.num_computed == 9
    while s.has_work():
        fake_step(s)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert s.cache.full.num_used == 0 and s.cache.sliding.num_used == 0


def test_lone_sequence_always_progresses_under_pressure():
    s = make(num_pages=3, sliding_pages=3, budget=64)
    s.add(seq("a", 4, max_tokens=7))  # ends up needing all 3 pages (11 tokens)
    steps = 0
    while s.has_work():
        fake_step(s)
        steps += 1
        assert steps < 20
    assert s.cache.full.num_used == 0


def test_parked_sequences_are_evicted_before_running_ones_are_preempted():
    s = make(num_pages=6, sliding_pages=6, budget=64)
    s.add(seq("p", 8, max_tokens=1, keep_alive=True))
    fake_step(s)
    assert "p" in s.parked and s.cache.full.num_used == 2
    s.add(seq("a", 16, max_tokens=6, start=5000))
    fake_step(s)  # needs 4 pages now and 6 later
    while s.has_work():
        fake_step(s)
    assert s.counters.parked_evictions == 1 and s.counters.preemptions == 0
    assert not s.parked


def test_continuation_takes_over_parked_pages():
    s = make()
    first = seq("p", 6, max_tokens=3, keep_alive=True)
    s.add(first)
    while s.has_work():
        fake_step(s)
    assert first.status == SequenceStatus.PARKED and first.num_computed == 8  # 9 tokens, last not run
    pages = list(first.pages.full)
    follow = Sequence(
        "q", first.token_ids + [5, 5], len(first.token_ids) + 2, SamplingParams(max_tokens=1), continue_from="p"
    )
    s.add(follow)
    assert not s.parked and follow.num_computed == 8 and follow.pages.full == pages
    assert fake_step(s) == [("q", 3)]  # only the sampled token and the two new ones
    assert follow.num_cached_tokens == 8
    assert s.counters.prefix_hit_tokens == 8


def plan_ahead(s: Scheduler, batch):
    """`StepOverlap.next_batch`'s call: the step after `batch`, before `batch` is applied."""
    inflight = {q: n for q, n in zip(batch.seqs, batch.num_new) if q.status == SequenceStatus.RUNNING}
    ending = frozenset(
        q
        for q, n in inflight.items()
        if q.num_computed + n == q.num_tokens and q.num_output_tokens + 1 >= q.sampling.max_tokens
    )
    return s.schedule_after(inflight, ending)


def test_planning_ahead_gives_the_synchronous_plan():
    """Every step planned before the previous one is applied is the step the synchronous
    scheduler plans after it (its decode rows first): chunks under the cap, admissions, a
    sequence that ends by length sitting out, pages reserved where the launched step leaves off."""

    def workload(s):
        s.add(seq("a", 20, max_tokens=9))
        s.add(seq("b", 30, max_tokens=6, start=2000))

    sync = make(budget=32, num_pages=128, sliding_pages=128, prefill_cap=8)
    workload(sync)
    want = [fake_step(sync)]
    while sync.has_work():
        want.append(fake_step(sync))
        if len(want) == 3:
            sync.add(seq("c", 11, max_tokens=3, start=3000))

    ahead = make(budget=32, num_pages=128, sliding_pages=128, prefill_cap=8)
    workload(ahead)
    batch = ahead.schedule()
    got = [steps(batch)]
    while True:
        if len(got) == 3:
            ahead.add(seq("c", 11, max_tokens=3, start=3000))
        nxt = plan_ahead(ahead, batch)
        apply_fake(ahead, batch)
        if nxt is None:
            assert not ahead.has_work()
            break
        got.append(steps(nxt))
        batch = nxt
    # Rows that decode come first ahead; the synchronous scheduler keeps running order.
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    assert got[2] == [("a", 1), ("b", 8)] and got[3] == [("a", 1), ("b", 2), ("c", 6)]
    assert ahead.cache.full.num_used == 0 and sync.cache.full.num_used == 0


def test_a_prefix_the_launched_step_computes_is_waited_for():
    """A request sharing a prompt's pages that the launched step is computing is not admitted
    ahead (it would miss them in the prefix cache), but in the step after, with the hit."""
    s = make(budget=16, num_pages=64, sliding_pages=64)
    shared = list(range(500, 516))
    a = Sequence("a", shared + [1, 2, 3], 19, SamplingParams(max_tokens=4))
    s.add(a)
    batch = s.schedule()
    assert steps(batch) == [("a", 16)]
    b = Sequence("b", shared + [9, 9], 18, SamplingParams(max_tokens=4))
    s.add(b)
    nxt = plan_ahead(s, batch)  # a's first 16 tokens are in flight: b waits
    assert steps(nxt) == [("a", 3)] and b.status == SequenceStatus.WAITING and not b.pages.holds_pages
    apply_fake(s, batch)
    after = plan_ahead(s, nxt)
    assert steps(after) == [("a", 1), ("b", 2)] and b.num_computed == 16
    assert s.counters.prefix_hit_tokens == 16


def test_planning_ahead_never_preempts():
    """Short of pages, the plan ahead gives up and changes nothing; the synchronous scheduler
    preempts once the launched step is applied."""
    s = make(budget=16, num_pages=6, sliding_pages=6, window=None)
    s.add(seq("a", 12, max_tokens=20))
    s.add(seq("b", 4, max_tokens=20, start=2000))
    batch = s.schedule()
    assert steps(batch) == [("a", 12), ("b", 4)]
    while (nxt := plan_ahead(s, batch)) is not None:
        apply_fake(s, batch)
        batch = nxt
    a, b = s.running
    assert not s.waiting and s.counters.preemptions == 0 and a.num_output_tokens < 20
    apply_fake(s, batch)
    assert steps(s.schedule()) == [("a", 1)] and s.counters.preemptions == 1 and s.waiting[0] is b
