"""Page bookkeeping of the paged KV cache: pools, sliding-window freeing, prefix sharing, sizing."""

from __future__ import annotations

import pytest
import torch

from inference.config import ModelConfig
from inference.scheduling.kv_cache import KVCacheManager, PagePool, PageTable, hash_page, plan_cache


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_pool_refcounts_and_lru_reuse():
    pool = PagePool(3)
    a, b, _ = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.num_free == 0
    pool.acquire(a)
    pool.release(a)
    assert pool.num_free == 0  # still held once
    pool.register(b, 1234)
    pool.release(b)  # cached content: handed out last
    pool.release(a)  # nothing cached: handed out first
    assert pool.num_free == 2
    assert pool.lookup(1234) == b
    assert pool.allocate() == a
    assert pool.allocate() == b
    assert pool.lookup(1234) is None  # reusing a page forgets what it held


def test_pool_revives_cached_free_page():
    pool = PagePool(2)
    page = pool.allocate()
    pool.register(page, 7)
    pool.release(page)
    pool.acquire(pool.lookup(7))
    assert pool.refcount[page] == 1 and pool.num_free == 1
    with pytest.raises(AssertionError):
        pool.release(page)
        pool.release(page)


def test_hash_chain_depends_on_whole_prefix():
    h1 = hash_page(None, [1, 2])
    assert hash_page(h1, [3, 4]) != hash_page(hash_page(None, [9, 2]), [3, 4])
    assert hash_page(h1, [3, 4]) == hash_page(hash_page(None, [1, 2]), [3, 4])


def test_sliding_pages_outside_window_are_freed():
    cache = KVCacheManager(num_full_pages=32, num_sliding_pages=32, page_size=4, window=8)
    table = PageTable()
    cache.reserve(table, 0, 20)  # prefill 20 tokens: pages 0..4 in both pools
    assert len(table.full) == 5 and all(p >= 0 for p in table.sliding)
    # Decoding position 20 reads keys 13..20: pages 3..5; pages 0..2 go back to the pool.
    cache.reserve(table, 20, 1)
    assert table.sliding[:3] == [-1, -1, -1] and all(p >= 0 for p in table.sliding[3:])
    assert len(table.full) == 6 and cache.full.num_used == 6
    assert cache.sliding.num_used == 3
    usage = cache.usage([(table, 21)])
    assert usage.sliding_pages_without_window == 6 and usage.sliding_pages_used == 3
    cache.release(table)
    assert cache.full.num_used == 0 and cache.sliding.num_used == 0


def test_fit_tokens_shrinks_to_free_pages():
    cache = KVCacheManager(num_full_pages=4, num_sliding_pages=4, page_size=4, window=8)
    table = PageTable()
    assert cache.fit_tokens(table, 0, 30) == 16
    other = PageTable()
    cache.reserve(other, 0, 9)  # takes 3 pages of each pool
    assert cache.fit_tokens(table, 0, 30) == 4
    assert not cache.can_reserve(table, 0, 5)
    with pytest.raises(RuntimeError):
        cache.reserve(table, 0, 5)


def fill(cache: KVCacheManager, ids: list[int]) -> PageTable:
    table = PageTable()
    cache.reserve(table, 0, len(ids))
    cache.register_computed(table, ids, len(ids))
    return table


def test_prefix_pages_are_shared_not_copied():
    cache = KVCacheManager(num_full_pages=16, num_sliding_pages=16, page_size=4, window=8)
    ids = tokens(10)
    first = fill(cache, ids)
    assert len(first.hashes) == 2  # the partial third page is not shared
    second = PageTable()
    cached = cache.match_prefix(second, ids + [5, 6], limit=11)
    assert cached == 8
    assert second.full == first.full[:2]
    assert cache.full.refcount[first.full[0]] == 2
    # A different first page shares nothing.
    third = PageTable()
    assert cache.match_prefix(third, [1] + ids[1:], limit=9) == 0
    assert not third.holds_pages


def test_prefix_survives_release_until_pages_are_needed():
    cache = KVCacheManager(num_full_pages=4, num_sliding_pages=4, page_size=4, window=8)
    ids = tokens(8)
    cache.release(fill(cache, ids))
    again = PageTable()
    assert cache.match_prefix(again, ids + [1], limit=8) == 8
    cache.release(again)
    # Another sequence needs all four pages: the cached prefix is evicted.
    cache.release(fill(cache, tokens(16, start=5000)))
    assert cache.match_prefix(PageTable(), ids + [1], limit=8) == 0


def test_prefix_reuse_needs_the_window_pages():
    """A prefix is usable at n tokens only if the sliding pages for positions n-7..n-1 are
    still cached; otherwise the match stops at an earlier point."""
    cache = KVCacheManager(num_full_pages=16, num_sliding_pages=16, page_size=4, window=8)
    ids = tokens(24)
    table = fill(cache, ids)
    sliding = list(table.sliding)
    cache.release(table)
    # Evict the sliding page of logical page 4 (positions 16..19).
    cache.sliding.unregister(sliding[4])
    probe = PageTable()
    # At 24 tokens the window (17..23) needs pages 4 and 5: not possible. At 20 it needs pages
    # 3 and 4: no. At 16 it needs pages 2 and 3: yes.
    assert cache.match_prefix(probe, ids + [1], limit=24) == 16
    assert probe.sliding == [-1, -1, sliding[2], sliding[3]]
    assert probe.full == table_full_prefix(cache, ids, 4)


def test_pages_planned_ahead_keep_the_sliding_pages_the_launched_step_fills():
    """Planning a step while the one that fills the positions before it is in flight (async
    scheduling) must not free the sliding pages that step fills before they are registered: a
    later request sharing the prompt would find those positions unusable. Once registered, the
    next reservation frees them, and they stay findable for prefix sharing."""
    ids = tokens(24)
    for ahead in (False, True):
        cache = KVCacheManager(num_full_pages=16, num_sliding_pages=16, page_size=4, window=8)
        table = PageTable()
        cache.reserve(table, 0, 16)  # chunk 1, launched
        assert cache.fit_tokens(table, 16, 8, ahead=ahead) == 8
        cache.reserve(table, 16, 8, ahead=ahead)  # chunk 2, planned before chunk 1 is applied
        # Chunk 2's first query (position 16) reads from position 9: pages 0 and 1 are out of its window.
        assert all(p >= 0 for p in table.sliding[:2]) == ahead
        cache.register_computed(table, ids, 16)  # chunk 1 applied
        cache.register_computed(table, ids, 24)  # chunk 2 applied
        cache.reserve(table, 24, 1)  # the next step frees what the window left behind, registered
        assert table.sliding[:4] == [-1, -1, -1, -1]
        cache.release(table)
        probe = PageTable()
        # At 8 tokens the window needs the sliding pages of positions 1..7: pages 0 and 1.
        assert cache.match_prefix(probe, ids[:8] + [1], limit=8) == (8 if ahead else 0)
        cache.release(probe)


def table_full_prefix(cache: KVCacheManager, ids: list[int], n: int) -> list[int]:
    pages, h = [], None
    for i in range(n):
        h = hash_page(h, ids[i * 4 : (i + 1) * 4])
        pages.append(cache.full.lookup(h))
    return pages


def test_take_over_reuses_partial_last_page():
    cache = KVCacheManager(num_full_pages=16, num_sliding_pages=16, page_size=4, window=8)
    parked_ids = tokens(11)  # 10 computed; the last sampled token has no KV yet
    parked = PageTable()
    cache.reserve(parked, 0, 10)
    cache.register_computed(parked, parked_ids, 10)
    pages = list(parked.full)
    table = PageTable()
    reused = cache.take_over(parked, parked_ids, 10, table, parked_ids + [7, 8, 9])
    assert reused == 10
    assert table.full == pages  # including the half-filled third page
    assert not parked.holds_pages
    assert cache.full.num_used == 3


def test_take_over_stops_at_divergence_and_never_writes_shared_pages():
    cache = KVCacheManager(num_full_pages=16, num_sliding_pages=16, page_size=4, window=8)
    parked_ids = tokens(13)
    parked = PageTable()
    cache.reserve(parked, 0, 12)
    cache.register_computed(parked, parked_ids, 12)
    sharer = PageTable()
    assert cache.match_prefix(sharer, parked_ids, limit=12) == 12  # holds all three pages too
    table = PageTable()
    diverged = parked_ids[:6] + [1, 2, 3]
    reused = cache.take_over(parked, parked_ids, 12, table, diverged)
    # Page 1 (positions 4..7) is shared, so writing position 6 into it is not allowed: reuse
    # falls back to the page boundary.
    assert reused == 4
    assert table.full == sharer.full[:1]


def test_take_over_without_window_pages_falls_back():
    cache = KVCacheManager(num_full_pages=16, num_sliding_pages=16, page_size=4, window=8)
    ids = tokens(30)
    parked = PageTable()
    cache.reserve(parked, 0, 20)
    cache.reserve(parked, 20, 9)  # frees sliding pages 0..2
    cache.register_computed(parked, ids, 29)
    table = PageTable()
    # Reusing only 6 tokens needs sliding pages 0 and 1, which are gone.
    assert cache.take_over(parked, ids, 29, table, ids[:6] + [1]) == 0
    assert not table.holds_pages and cache.full.num_used == 0 and cache.sliding.num_used == 0


def small_config(**overrides) -> ModelConfig:
    values = dict(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        sliding_window=128,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return ModelConfig(**{**values, **overrides})


def test_plan_gives_the_window_saving_to_full_layers():
    config = small_config()
    per_page = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers of a kind * (K, V) * page * heads * dim * fp32
    plan = plan_cache(
        config, 16, torch.float32, memory_bytes=10_000 * 2 * per_page, max_num_seqs=8, max_num_batched_tokens=256
    )
    assert plan.bytes_per_full_page == plan.bytes_per_sliding_page == per_page
    assert plan.total_bytes <= 10_000 * 2 * per_page
    # Running sequences need at most 8 * (8 + 3) + 16 = 104 sliding pages; twice that is kept.
    assert plan.num_sliding_pages == 208
    assert plan.num_full_pages == 20_000 - 208


def test_plan_with_explicit_pages_and_no_sliding_layers():
    plan = plan_cache(small_config(), 16, torch.float32, num_pages=50)
    assert plan.num_full_pages == 50 and plan.num_sliding_pages == 50
    full_only = small_config(layer_types=("full_attention",) * 4)
    plan = plan_cache(full_only, 16, torch.float32, memory_bytes=1 << 20)
    assert plan.num_sliding_pages == 0 and plan.bytes_per_sliding_page == 0
    assert plan.num_full_pages == (1 << 20) // (4 * 2 * 16 * 2 * 16 * 4)


@pytest.mark.parametrize("window", [None, 8, 6])
def test_held_pages_shortcut_changes_nothing(window, monkeypatch):
    """`fit_tokens` / `reserve` skip their work when a step's pages are all held and the window
    frees nothing (`_holds`, O(1)). Driven through the same random scheduler-like workload
    (prompts prefilled in chunks, decode steps, sequences finished and their prefixes reused,
    drafts rolled back), a manager with the shortcut and one without it end every step with the
    same page tables, free pages and answers."""
    import random

    real_holds = KVCacheManager._holds
    taken = []

    def run(shortcut: bool) -> list:
        def holds(self, table, start, num_new):
            held = shortcut and real_holds(self, table, start, num_new)
            taken.append(held)
            return held

        monkeypatch.setattr(KVCacheManager, "_holds", holds)
        rng = random.Random(7)
        cache = KVCacheManager(48, 48, 4, window)
        live: list[tuple[PageTable, list[int], int]] = []
        trace = []
        for step in range(400):
            if len(live) < 4 and rng.random() < 0.3:  # admit, maybe over a cached prefix
                ids = tokens(rng.randrange(1, 30), start=100 * rng.randrange(3))
                table = PageTable()
                live.append((table, ids, cache.match_prefix(table, ids, len(ids) - 1)))
            for i, (table, ids, done) in enumerate(live):
                want = 1 if done >= len(ids) - 1 else min(len(ids) - done, rng.randrange(1, 9))
                want += rng.randrange(3) if want == 1 else 0  # drafts beside a decode row
                n = cache.fit_tokens(table, done, want)
                trace.append((step, i, "fit", n))
                if n == 0:
                    continue
                cache.reserve(table, done, n)
                kept = n if want == n else rng.randrange(1, n + 1)
                while len(ids) < done + kept + 1:
                    ids.append(rng.randrange(1000))
                cache.truncate(table, done + kept) if kept < n else None
                cache.register_computed(table, ids, done + kept)
                live[i] = (table, ids, done + kept)
                trace.append((step, i, list(table.full), list(table.sliding)))
            if live and rng.random() < 0.1:  # a sequence ends
                table, _, _ = live.pop(rng.randrange(len(live)))
                cache.release(table)
            trace.append((step, cache.full.num_free, cache.sliding.num_free))
        return trace

    assert run(shortcut=False) == run(shortcut=True)
    assert taken.count(True) >= 100  # (the shortcut was taken, often)
