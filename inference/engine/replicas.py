"""Data parallelism: N engine replicas behind one `EngineClient`, each request routed to one.

Each replica is a whole engine (its own process, its own GPU or tensor-parallel group of GPUs,
its own KV cache). `ReplicaRouter` picks the replica for every request:

    a continuation (`continue_from`)   the replica holding the parked sequence it continues
                                       (its KV pages live there and nowhere else)
    anything else                      the replica of least cost: prompt tokens it has not
                                       cached, plus REQUEST_COST_TOKENS per request in flight
                                       (so a cached prefix wins until its replica is busier)

"Seen" is kept by `PrefixIndex`: the chained hashes of a prompt's full 16-token blocks (the
KV cache's page size, so a match is what the engine's prefix cache can reuse), recorded for the
replica a prompt went to, and for prompt + output when it finishes (the next turn of the same
conversation starts with them). The index is an estimate of what each engine caches (an engine
may have evicted a block since), and a bounded LRU.

A replica whose process died (`failure`) is out of rotation: its open streams end with an error
delta (`EngineProcess` does that), new requests go to the others. The router fails only when
every replica has. The router runs on the server's event loop, like the clients it wraps.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from dataclasses import dataclass

from inference.request import EngineStats, GenerationRequest, TokenDelta

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # the KV cache's page size (`EngineConfig.page_size`)
INDEX_BLOCKS = 1 << 20  # block hashes remembered, over all replicas (LRU; ~100 MB when full)
# What one request in flight weighs against prompt tokens found cached: a replica that has a
# prompt's prefix wins while its queue is longer by fewer than (cached tokens / this) requests, so
# a shared system prompt does not pile everything onto one replica, and a long conversation's
# next turn stays where its history is cached.
REQUEST_COST_TOKENS = 256
# `EngineStats` fields that are a state now, not a count since start (a lost replica's are dropped).
GAUGES = frozenset({"running", "waiting", "parked", "pages_total", "pages_used"})


class PrefixIndex:
    """Which replica has seen which prompt prefixes: a bounded LRU of block-hash chains, each
    with a bitmask of the replicas that have it (about 100 bytes a block).

    A block's hash covers every token before it (the hash of the previous block and its own 16
    tokens), so one look-up per block tells how long a prefix matches."""

    def __init__(self, capacity: int = INDEX_BLOCKS, block_tokens: int = BLOCK_TOKENS):
        self.capacity, self.block_tokens = capacity, block_tokens
        self._owners: collections.OrderedDict[int, int] = collections.OrderedDict()  # hash -> replica bits

    def hashes(self, tokens: list[int], known: list[int] = ()) -> list[int]:
        """The chained hashes of `tokens`' full blocks, in order; `known`: those of its first
        blocks, already computed (the prompt's, for prompt + output)."""
        out, previous = list(known), known[-1] if known else 0
        block = self.block_tokens
        for start in range(len(known) * block, len(tokens) - block + 1, block):
            previous = hash((previous, *tokens[start : start + block]))
            out.append(previous)
        return out

    def record(self, replica: int, hashes: list[int]) -> None:
        bit = 1 << replica
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None:
                self._owners[h] = bit
            else:
                self._owners[h] = owners | bit
                self._owners.move_to_end(h)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica is gone: its blocks match nothing any more."""
        keep = ~(1 << replica)
        for h in list(self._owners):
            self._owners[h] &= keep

    def matches(self, hashes: list[int], replicas: int) -> list[int]:
        """Per replica, how many leading blocks of `hashes` it has seen."""
        found = [0] * replicas
        alive = (1 << replicas) - 1
        for depth, h in enumerate(hashes, start=1):
            alive &= self._owners.get(h, 0)
            if not alive:
                break
            for r in range(replicas):
                if alive >> r & 1:
                    found[r] = depth
        return found


@dataclass
class ReplicaCounters:
    """What the router itself counts for one replica (the engine's own counters: `stats`)."""

    routed: int = 0  # requests sent there
    routed_by_prefix: int = 0  # of those, because it had seen the prompt's prefix
    routed_by_continuation: int = 0  # of those, to continue a parked sequence
    in_flight: int = 0  # requests sent and not yet finished


class ReplicaRouter:
    """N engine clients (`EngineProcess`es) as one `EngineClient`."""

    def __init__(self, replicas: list, *, index: PrefixIndex | None = None):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.model_name: str = first.model_name
        self.max_model_len: int = min(r.max_model_len for r in self.replicas)
        self.vocab_size: int = first.vocab_size
        self.index = index or PrefixIndex()
        self.counters = [ReplicaCounters() for _ in self.replicas]
        self._owner: dict[str, int] = {}  # request id -> replica, while running or parked there
        self._parked: set[str] = set()  # request ids whose sequence stays parked (keep_alive)
        self._out: set[int] = set()  # replicas taken out of rotation
        self._last_stats: dict[int, EngineStats] = {}  # each replica's counters as last read

    # -- routing ---------------------------------------------------------------------------

    def live(self) -> list[int]:
        """The replicas in rotation (a replica found dead is taken out, for good)."""
        for i, replica in enumerate(self.replicas):
            if i not in self._out and getattr(replica, "failure", None):
                self._take_out(i, replica.failure)
        return [i for i in range(len(self.replicas)) if i not in self._out]

    def _take_out(self, i: int, cause: str) -> None:
        self._out.add(i)
        self.index.forget(i)
        for rid in [rid for rid, r in self._owner.items() if r == i]:
            del self._owner[rid]
            self._parked.discard(rid)
        log.error("engine replica %d is out of rotation: %s", i, cause)

    def choose(self, request: GenerationRequest, hashes: list[int]) -> tuple[int, str]:
        """(replica, why) for `request`, whose prompt's block hashes are `hashes`: see the
        module docstring."""
        live = self.live()
        if not live:
            raise RuntimeError(self.failure or "no engine replica is serving")
        if request.continue_from is not None:
            owner = self._owner.get(request.continue_from)
            if owner is not None and owner in live:
                return owner, "continuation"
        matched = self.index.matches(hashes, len(self.replicas))
        # Cost in prompt tokens: what the replica's cache would not cover, plus its queue.
        cost = {
            i: self.counters[i].in_flight * REQUEST_COST_TOKENS - matched[i] * self.index.block_tokens for i in live
        }
        chosen = min(live, key=lambda i: (cost[i], self.counters[i].in_flight, self.counters[i].routed))
        if matched[chosen] > min(matched[i] for i in live):
            return chosen, "prefix"
        return chosen, "load"

    # -- EngineClient ----------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> RoutedStream:
        """Route now, validate on the replica (ValueError / RuntimeError as a client raises)."""
        if request.request_id in self._owner and request.request_id not in self._parked:
            raise ValueError(f"request id {request.request_id!r} is already running")
        hashes = self.index.hashes(request.prompt_token_ids)
        replica, why = self.choose(request, hashes)
        stream = self.replicas[replica].generate(request)
        return RoutedStream(self, replica, why, request, hashes, stream)

    def abort(self, request_id: str) -> None:
        owner = self._owner.get(request_id)
        if owner is not None and owner not in self._out:
            self.replicas[owner].abort(request_id)

    def release(self, request_id: str) -> None:
        owner = self._owner.get(request_id)
        if owner is None or request_id not in self._parked:
            return
        self._parked.discard(request_id)
        del self._owner[request_id]
        if owner not in self._out:
            self.replicas[owner].release(request_id)

    def stats(self) -> EngineStats:
        """Every replica's counters added up: the live ones' as they are now, a lost one's
        monotonic counters as it left them (so totals never go back), its gauges not at all."""
        total = EngineStats()
        live = self.live()
        for i in range(len(self.replicas)):
            s = self.replicas[i].stats() if i in live else self._last_stats.get(i)
            if s is None:
                continue
            if i in live:
                self._last_stats[i] = s
            for f in dataclasses.fields(EngineStats):
                if i in live or f.name not in GAUGES:
                    setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
        return total

    def replica_stats(self) -> list[tuple[int, bool, EngineStats | None, ReplicaCounters]]:
        """(replica, in rotation, its engine's counters or None once out, the router's counters)."""
        live = set(self.live())
        return [
            (i, i in live, self.replicas[i].stats() if i in live else None, self.counters[i])
            for i in range(len(self.replicas))
        ]

    @property
    def failure(self) -> str | None:
        """Why no request can be served: every replica has failed (their causes), else None."""
        causes = [getattr(r, "failure", None) for r in self.replicas]
        if all(causes):
            return "every engine replica has failed: " + "; ".join(f"replica {i}: {c}" for i, c in enumerate(causes))
        return None

    async def wait_idle(self) -> None:
        await asyncio.gather(*(r.wait_idle() for i, r in enumerate(self.replicas) if i not in self._out))

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)

    # -- a stream's life -------------------------------------------------------------------

    def _opened(self, replica: int, why: str, request: GenerationRequest, hashes: list[int]) -> None:
        self._owner[request.request_id] = replica  # (a parked id it continues stays until `release`)
        counters = self.counters[replica]
        counters.routed += 1
        counters.in_flight += 1
        if why == "prefix":
            counters.routed_by_prefix += 1
        elif why == "continuation":
            counters.routed_by_continuation += 1
        self.index.record(replica, hashes)

    def _finished(
        self, replica: int, request: GenerationRequest, hashes: list[int], output: list[int], delta: TokenDelta | None
    ) -> None:
        rid = request.request_id
        self.counters[replica].in_flight -= 1
        if replica in self._out:
            return
        if delta is not None and delta.finish_reason in ("stop", "length"):
            self.index.record(replica, self.index.hashes(request.prompt_token_ids + output, known=hashes))
        if request.keep_alive and delta is not None and delta.finish_reason in ("stop", "length"):
            self._parked.add(rid)  # until `release` (or a continuation takes it over)
        elif self._owner.get(rid) == replica:
            del self._owner[rid]


class RoutedStream:
    """A replica's `DeltaStream`, telling the router when it opens and ends."""

    def __init__(
        self, router: ReplicaRouter, replica: int, why: str, request: GenerationRequest, hashes: list[int], stream
    ):
        self.router, self.replica, self.why, self.request = router, replica, why, request
        self.hashes = hashes  # the prompt's block hashes (`PrefixIndex.hashes`)
        self._stream = stream
        self._opened = False
        self._ended = False
        self._output: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self) -> None:
        if self._opened:
            return
        self._stream.open()
        self._opened = True
        self._loop = asyncio.get_running_loop()
        self.router._opened(self.replica, self.why, self.request, self.hashes)

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> TokenDelta:
        self.open()
        try:
            delta = await self._stream.__anext__()
        except StopAsyncIteration:
            self._end(None)
            raise
        except BaseException:
            self._end(None)
            raise
        self._output.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self._end(delta)
        return delta

    async def aclose(self) -> None:
        await self._stream.aclose()
        self._end(None)

    def _end(self, delta: TokenDelta | None) -> None:
        if self._opened and not self._ended:
            self._ended = True
            self.router._finished(self.replica, self.request, self.hashes, self._output, delta)

    def __del__(self) -> None:
        # Dropped unfinished: the replica's own stream aborts the request; the router's count
        # is settled on the loop (a garbage collection may run this inside the router's code).
        if self._opened and not self._ended:
            try:
                self._loop.call_soon_threadsafe(self._end, None)
            except Exception:  # the loop is closed: nothing is left to count
                pass


def replica_devices(device: str | None, data_parallel_size: int, tensor_parallel_size: int = 1) -> list[str]:
    """Each replica's first device: consecutive groups of `tensor_parallel_size` GPUs from
    `device` on (default cuda:0, or the CPU where there is no GPU), or the CPU for all."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return [str(device)] * data_parallel_size
    first = device.index if device.index is not None else 0
    needed = data_parallel_size * tensor_parallel_size
    count = torch.cuda.device_count()
    if first + needed > count:
        raise ValueError(
            f"data_parallel_size {data_parallel_size} x tensor_parallel_size {tensor_parallel_size} needs GPUs "
            f"{first}..{first + needed - 1}; {count} are visible"
        )
    return [f"cuda:{first + i * tensor_parallel_size}" for i in range(data_parallel_size)]


def start_replicas(spec, data_parallel_size: int) -> ReplicaRouter:
    """`data_parallel_size` engine processes built from `spec` (an `EngineSpec`; its
    options' device is the first replica's), started side by side, behind one router. If one
    fails to build, the others are stopped and RuntimeError names it."""
    from concurrent.futures import ThreadPoolExecutor

    from inference.engine.process import EngineProcess

    options = dict(spec.options)
    devices = replica_devices(options.get("device"), data_parallel_size, options.get("tensor_parallel_size") or 1)
    specs = [dataclasses.replace(spec, options={**options, "device": d}) for d in devices]
    with ThreadPoolExecutor(max_workers=data_parallel_size, thread_name_prefix="replica-start") as pool:
        futures = [pool.submit(EngineProcess, s) for s in specs]
        started, errors = [], []
        for i, future in enumerate(futures):
            try:
                started.append(future.result())
            except Exception as e:
                errors.append(f"replica {i} ({devices[i]}): {e}")
    if errors:
        for client in started:
            client.stop_now()
        raise RuntimeError("; ".join(errors))
    log.info(
        "data parallel: %d engine replicas: %s",
        data_parallel_size,
        ", ".join(f"{i} on {d} (pid {c.pid})" for i, (d, c) in enumerate(zip(devices, started))),
    )
    return ReplicaRouter(started)
