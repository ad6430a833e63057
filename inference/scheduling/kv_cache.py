"""The paged KV cache: two page pools, per-sequence page tables, prefix sharing.

Memory is cut into pages of `page_size` token slots. Full-attention layers and sliding-window
layers draw from separate pools, because a sliding layer only ever reads the last `window`
positions: once a page falls out of every future query's window it goes back to its pool
(its page-table entry becomes -1), so the sliding pool can be far smaller than the full one.

Prefix sharing: when a page's tokens are all computed it is registered under a hash of the whole
prefix up to and including it (a chain: hash(previous page's hash, this page's tokens)), in both
pools. A new sequence whose prompt starts with the same pages takes them instead of computing
them again (reference counts track sharers). Pages with no holder stay cached until the pool
needs them (least recently released first). A prefix is only reusable at a point where the
sliding pages that the next query's window needs are also still cached.

Nothing here touches tensors except `allocate_kv_tensors`; the pools are pure bookkeeping.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from inference.config import EngineConfig, ModelConfig


def hash_page(previous: int | None, tokens: list[int]) -> int:
    """Content hash of a page given the hash of the page before it (None for the first)."""
    h = hashlib.blake2b(digest_size=16)
    if previous is not None:
        h.update(previous.to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class PagePool:
    """Physical pages 0..num_pages-1 with reference counts and a content-hash index.

    A page is held (refcount > 0) or free. Free pages are handed out least recently released
    first; a free page that still has a registered hash keeps its content until then, so a later
    `lookup` can revive it.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.cached: dict[int, int] = {}  # hash -> page
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def allocate(self) -> int:
        page, _ = self.free.popitem(last=False)
        self.unregister(page)  # its old content is about to be overwritten
        self.refcount[page] = 1
        return page

    def acquire(self, page: int) -> None:
        """Take one more reference to `page` (a cached free page leaves the free list)."""
        if self.refcount[page] == 0:
            del self.free[page]
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        self.refcount[page] -= 1
        assert self.refcount[page] >= 0, f"page {page} released more often than taken"
        if self.refcount[page] == 0:
            self.free[page] = None
            if self.page_hash[page] is None:
                # Nothing worth keeping: hand it out before pages that hold cached prefixes.
                self.free.move_to_end(page, last=False)

    def register(self, page: int, content_hash: int) -> None:
        """Record that `page` holds the KV of the prefix hashed `content_hash` (first one wins)."""
        if content_hash not in self.cached and self.page_hash[page] is None:
            self.cached[content_hash] = page
            self.page_hash[page] = content_hash

    def unregister(self, page: int) -> None:
        h = self.page_hash[page]
        if h is not None:
            del self.cached[h]
            self.page_hash[page] = None

    def lookup(self, content_hash: int) -> int | None:
        return self.cached.get(content_hash)


@dataclass
class PageTable:
    """The pages one sequence holds. Logical page i covers positions i*page_size .. +page_size-1.

    full:    physical page in the full pool per logical page.
    sliding: physical page in the sliding pool per logical page; -1 once outside the window.
    hashes:  prefix hash of each leading logical page whose tokens are all computed and hashed.
    """

    full: list[int] = field(default_factory=list)
    sliding: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)

    @property
    def holds_pages(self) -> bool:
        return bool(self.full)


@dataclass
class CacheUsage:
    """Page counts of both pools. `sliding_pages_without_window` is what the sliding layers
    would hold if they kept every page, as full layers do: the saving is the difference."""

    page_size: int
    full_pages_total: int
    full_pages_used: int
    sliding_pages_total: int
    sliding_pages_used: int
    sliding_pages_without_window: int
    bytes_per_full_page: int
    bytes_per_sliding_page: int

    @property
    def sliding_bytes_saved(self) -> int:
        return max(0, self.sliding_pages_without_window - self.sliding_pages_used) * self.bytes_per_sliding_page


class KVCacheManager:
    """Page bookkeeping for every sequence: reserve pages for a step, free what the sliding
    window left behind, share prefixes, hand a parked sequence's pages to its continuation.

    window: the sliding layers' window, or None when the model has no sliding layers (then the
    sliding pool is unused and sliding page tables stay empty).
    """

    def __init__(
        self,
        num_full_pages: int,
        num_sliding_pages: int,
        page_size: int,
        window: int | None,
        bytes_per_full_page: int = 0,
        bytes_per_sliding_page: int = 0,
    ):
        self.page_size = page_size
        self.window = window
        self.full = PagePool(num_full_pages)
        self.sliding = PagePool(num_sliding_pages if window is not None else 0)
        self.bytes_per_full_page = bytes_per_full_page
        self.bytes_per_sliding_page = bytes_per_sliding_page

    # -- sizes ---------------------------------------------------------------------------------

    def num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def first_window_page(self, start: int) -> int:
        """Lowest logical page a query at position >= `start` can read on a sliding layer."""
        return max(0, start - self.window + 1) // self.page_size

    # -- reserving pages for a step ------------------------------------------------------------

    def trim_window(self, table: PageTable, start: int, keep_unregistered: bool = False) -> None:
        """Free sliding pages no query at position >= `start` will read. keep_unregistered: only
        those already registered for prefix sharing (a step planned before the launched one
        that fills the others is applied; see `reserve`)."""
        if self.window is None:
            return
        # Held sliding pages always form one run up to the end of the table, so walk down from
        # the window's edge until the first already-freed entry.
        i = min(self.first_window_page(start), len(table.sliding)) - 1
        if keep_unregistered:
            i = min(i, len(table.hashes) - 1)
        while i >= 0 and table.sliding[i] >= 0:
            self.sliding.release(table.sliding[i])
            table.sliding[i] = -1
            i -= 1

    def _pages_missing(self, table: PageTable, start: int, num_new: int) -> tuple[int, int]:
        """(full, sliding) pages to allocate so positions [start, start+num_new) can be written."""
        end_page = self.num_pages(start + num_new)
        full = max(0, end_page - len(table.full))
        sliding = 0
        if self.window is not None:
            first = self.first_window_page(start)
            have = sum(1 for p in table.sliding[first:end_page] if p >= 0)
            sliding = (end_page - first) - have
        return full, sliding

    def _holds(self, table: PageTable, start: int, num_new: int) -> bool:
        """Whether positions [start, start+num_new) already have every page they need and the
        window leaves no sliding page to free: a decode row's step but once every page_size
        tokens. O(1), because held sliding pages form one run up to the end of the table (see
        `trim_window`): the window's first page held means all after it are, and the page
        before it already freed means there is nothing to trim."""
        end_page = (start + num_new - 1) // self.page_size + 1
        if end_page > len(table.full):
            return False
        if self.window is None:
            return True
        first = self.first_window_page(start)
        return (
            end_page <= len(table.sliding)
            and table.sliding[first] >= 0
            and (first == 0 or table.sliding[first - 1] < 0)
        )

    def can_reserve(self, table: PageTable, start: int, num_new: int) -> bool:
        full, sliding = self._pages_missing(table, start, num_new)
        return full <= self.full.num_free and sliding <= self.sliding.num_free

    def fit_tokens(self, table: PageTable, start: int, num_new: int, ahead: bool = False) -> int:
        """The most tokens (<= num_new) starting at `start` whose pages can be reserved now."""
        if num_new > 0 and self._holds(table, start, num_new):
            return num_new
        self.trim_window(table, start, keep_unregistered=ahead)
        n = num_new
        while n > 0 and not self.can_reserve(table, start, n):
            # Fewer tokens only help when they end on an earlier page.
            n = (start + n - 1) // self.page_size * self.page_size - start
        return max(n, 0)

    def reserve(self, table: PageTable, start: int, num_new: int, ahead: bool = False) -> None:
        """Allocate pages for positions [start, start+num_new); call `fit_tokens` first.

        ahead: planned while a launched step that fills the positions before `start` is not
        applied yet (async scheduling). Sliding pages it fills that fall out of the window stay
        held until it is: freed before being registered, they would be lost to prefix sharing."""
        if num_new > 0 and self._holds(table, start, num_new):
            return
        self.trim_window(table, start, keep_unregistered=ahead)
        if not self.can_reserve(table, start, num_new):
            raise RuntimeError("reserve() called without room; check fit_tokens() first")
        end_page = self.num_pages(start + num_new)
        while len(table.full) < end_page:
            table.full.append(self.full.allocate())
        if self.window is not None:
            while len(table.sliding) < end_page:
                table.sliding.append(-1)
            for i in range(self.first_window_page(start), end_page):
                if table.sliding[i] < 0:
                    table.sliding[i] = self.sliding.allocate()

    def truncate(self, table: PageTable, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` positions, e.g. those that only held
        the K/V of rejected draft tokens. Such pages hold no fully computed page of tokens, so
        none of them was registered for prefix sharing."""
        keep = self.num_pages(num_tokens)
        assert len(table.hashes) <= keep, "truncating below a registered page"
        for page in table.full[keep:]:
            self.full.release(page)
        del table.full[keep:]
        for page in table.sliding[keep:]:
            if page >= 0:
                self.sliding.release(page)
        del table.sliding[keep:]

    def release(self, table: PageTable) -> None:
        """Drop every page the table holds (cached ones stay cached until reused)."""
        for page in table.full:
            self.full.release(page)
        for page in table.sliding:
            if page >= 0:
                self.sliding.release(page)
        table.full, table.sliding, table.hashes = [], [], []

    # -- prefix sharing ------------------------------------------------------------------------

    def register_computed(self, table: PageTable, token_ids: list[int], num_computed: int) -> None:
        """Hash and publish pages that `num_computed` tokens have now filled."""
        ps = self.page_size
        for i in range(len(table.hashes), num_computed // ps):
            previous = table.hashes[-1] if table.hashes else None
            h = hash_page(previous, token_ids[i * ps : (i + 1) * ps])
            table.hashes.append(h)
            self.full.register(table.full[i], h)
            if self.window is not None and table.sliding[i] >= 0:
                self.sliding.register(table.sliding[i], h)

    def match_prefix(self, table: PageTable, token_ids: list[int], limit: int) -> int:
        """Take cached pages for the longest reusable prefix of at most `limit` tokens.

        The table must be empty. Returns the number of tokens now cached (a multiple of
        page_size). Reusable means every full page up to that point is cached and, for sliding
        layers, so is every page the next query's window reaches back to.
        """
        assert not table.holds_pages
        ps = self.page_size
        hashes: list[int] = []
        full_pages: list[int] = []
        for i in range(limit // ps):
            h = hash_page(hashes[-1] if hashes else None, token_ids[i * ps : (i + 1) * ps])
            page = self.full.lookup(h)
            if page is None:
                break
            hashes.append(h)
            full_pages.append(page)
        num = len(full_pages)
        sliding_pages: list[int] = []
        if self.window is not None:
            while num > 0:
                first = self.first_window_page(num * ps)
                sliding_pages = [self.sliding.lookup(h) for h in hashes[first:num]]
                if all(p is not None for p in sliding_pages):
                    sliding_pages = [-1] * first + sliding_pages
                    break
                num -= 1
        if num == 0:
            return 0
        for page in full_pages[:num]:
            self.full.acquire(page)
        for page in sliding_pages:
            if page >= 0:
                self.sliding.acquire(page)
        table.full, table.sliding, table.hashes = full_pages[:num], sliding_pages, hashes[:num]
        return num * ps

    def take_over(
        self, parked: PageTable, parked_tokens: list[int], parked_computed: int, table: PageTable, token_ids: list[int]
    ) -> int:
        """Move a parked sequence's pages to a new sequence that continues it.

        `parked_computed` tokens of `parked_tokens` have KV in `parked`. Reuses the longest
        common prefix with `token_ids` (leaving at least the last token to compute), including a
        partly filled last page, which is where this beats plain prefix sharing. Returns the
        number of reused tokens; on 0 the parked pages were simply released.
        """
        assert not table.holds_pages
        ps = self.page_size
        common = 0
        limit = min(parked_computed, len(token_ids) - 1, len(parked_tokens))
        while common < limit and parked_tokens[common] == token_ids[common]:
            common += 1
        reuse = common
        # New tokens will be written into page reuse // ps from offset reuse % ps on; we may only
        # write into a page nobody else holds.
        if reuse % ps and not self._exclusive(parked, reuse // ps):
            reuse -= reuse % ps
        if self.window is not None and reuse > 0:
            first = self.first_window_page(reuse)
            if any(p < 0 for p in parked.sliding[first : self.num_pages(reuse)]):
                reuse = 0
        if reuse == 0:
            self.release(parked)
            return 0
        keep = self.num_pages(reuse)
        table.full, parked.full = parked.full[:keep], parked.full[keep:]
        if self.window is not None:
            table.sliding, parked.sliding = parked.sliding[:keep], parked.sliding[keep:]
        table.hashes = parked.hashes[: reuse // ps]
        if reuse % ps:
            # The partly reused page's old tail will be overwritten: stop offering it.
            self.full.unregister(table.full[-1])
            if self.window is not None:
                self.sliding.unregister(table.sliding[-1])
        self.release(parked)
        self.trim_window(table, reuse)
        return reuse

    def _exclusive(self, table: PageTable, index: int) -> bool:
        if self.full.refcount[table.full[index]] != 1:
            return False
        if self.window is None:
            return True
        page = table.sliding[index]
        return page >= 0 and self.sliding.refcount[page] == 1

    # -- reporting -----------------------------------------------------------------------------

    def usage(self, tables: list[tuple[PageTable, int]]) -> CacheUsage:
        """Counts now; `tables` are the live sequences' tables with their computed token counts."""
        without_window = sum(self.num_pages(n) for _, n in tables) if self.window is not None else 0
        return CacheUsage(
            page_size=self.page_size,
            full_pages_total=self.full.num_pages,
            full_pages_used=self.full.num_used,
            sliding_pages_total=self.sliding.num_pages,
            sliding_pages_used=self.sliding.num_used,
            sliding_pages_without_window=without_window,
            bytes_per_full_page=self.bytes_per_full_page,
            bytes_per_sliding_page=self.bytes_per_sliding_page,
        )


# -- physical memory ---------------------------------------------------------------------------


def bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype, sliding: bool) -> int:
    """K and V bytes of one page summed over the layers of one kind."""
    layers = sum(1 for i in range(config.num_hidden_layers) if config.is_sliding(i) == sliding)
    elem = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * page_size * config.num_key_value_heads * config.head_dim * elem


def sliding_pages_needed(window: int, page_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Sliding pages that can be in use at once: each running sequence holds its window (plus
    partial pages at both ends) and a step's new tokens add at most their own pages."""
    per_seq = -(-(window - 1) // page_size) + 3
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // page_size)


@dataclass
class CachePlan:
    num_full_pages: int
    num_sliding_pages: int
    bytes_per_full_page: int
    bytes_per_sliding_page: int

    @property
    def total_bytes(self) -> int:
        return self.num_full_pages * self.bytes_per_full_page + self.num_sliding_pages * self.bytes_per_sliding_page


def plan_cache(
    config: ModelConfig,
    page_size: int,
    dtype: torch.dtype,
    *,
    memory_bytes: int | None = None,
    num_pages: int | None = None,
    num_sliding_pages: int | None = None,
    max_num_seqs: int = EngineConfig.max_num_seqs,
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
    max_model_len: int | None = None,
    extra_full_page_bytes: int = 0,
) -> CachePlan:
    """Pool sizes from an explicit page count or a memory budget.

    With a budget the sliding pool gets what running sequences can need at once (twice that,
    for cached prefixes) and the full pool the rest, so the window's saving turns into more
    full-attention context. Without sliding layers the sliding pool is empty.
    `extra_full_page_bytes`: what else each full-pool page costs (an EAGLE-3 draft layer's K/V,
    which is indexed by the same page tables).
    """
    full_bytes = bytes_per_page(config, page_size, dtype, sliding=False) + extra_full_page_bytes
    sliding_bytes = bytes_per_page(config, page_size, dtype, sliding=True)
    has_sliding = sliding_bytes > 0
    wanted_sliding = 2 * sliding_pages_needed(config.sliding_window, page_size, max_num_seqs, max_num_batched_tokens)
    if num_pages is None:
        if memory_bytes is None:
            raise ValueError("give num_pages or a memory budget")
        if num_sliding_pages is not None:
            memory_bytes -= num_sliding_pages * sliding_bytes
            num_pages = memory_bytes // max(full_bytes, 1)
        elif not has_sliding:
            num_pages = memory_bytes // max(full_bytes, 1)
        else:
            # Full pool first as if the sliding pool were wanted_sliding; if that leaves fewer
            # full pages than sliding ones, split evenly (the sliding pool never needs more).
            num_pages = (memory_bytes - wanted_sliding * sliding_bytes) // max(full_bytes, 1)
            if num_pages < wanted_sliding:
                num_pages = memory_bytes // (full_bytes + sliding_bytes)
        if max_model_len is not None:
            num_pages = min(num_pages, max_num_seqs * -(-max_model_len // page_size))
    if num_sliding_pages is None:
        num_sliding_pages = min(num_pages, wanted_sliding) if has_sliding else 0
    if num_pages < 1:
        raise ValueError(f"the KV cache budget holds no page of {full_bytes} bytes")
    return CachePlan(num_pages, num_sliding_pages if has_sliding else 0, full_bytes, sliding_bytes)


def allocate_kv_tensors(
    config: ModelConfig, plan: CachePlan, page_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, [pool pages, page_size, Hkv, D], from its kind's pool."""
    caches = []
    for layer in range(config.num_hidden_layers):
        pages = plan.num_sliding_pages if config.is_sliding(layer) else plan.num_full_pages
        shape = (max(pages, 1), page_size, config.num_key_value_heads, config.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)))
    return caches


def describe_plan(plan: CachePlan, config: ModelConfig, page_size: int, dtype: torch.dtype | None = None) -> str:
    gib = 1 << 30
    full = plan.num_full_pages * plan.bytes_per_full_page / gib
    sliding = plan.num_sliding_pages * plan.bytes_per_sliding_page / gib
    # Without window freeing, sliding layers would need as many pages as full layers.
    saved = max(0, plan.num_full_pages - plan.num_sliding_pages) * plan.bytes_per_sliding_page / gib
    kind = "" if dtype is None else f" ({str(dtype).removeprefix('torch.')})"
    return (
        f"KV cache{kind}: {plan.num_full_pages} full-layer pages ({full:.2f} GiB, "
        f"{plan.num_full_pages * page_size} tokens), {plan.num_sliding_pages} sliding-layer pages "
        f"({sliding:.2f} GiB); keeping only the last {config.sliding_window} positions on sliding "
        f"layers saves {saved:.2f} GiB against a full cache of the same capacity"
    )
