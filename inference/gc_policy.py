"""How the garbage collector runs in a process that serves steps: out of the way of the stream.

CPython's cyclic collector runs a young collection whenever tracked objects allocated minus
those freed pass 700; every tenth of those is followed by an older one, and a full collection
walks every tracked object there is. A serving process holds about 280,000 of them once the model
is built (modules, torch, the engine), and each step makes and drops objects for every
sequence in it. At 256 streams young collections came about once a step (2,570 in a one-minute
run of ~3,260 steps), and full collections, a few a minute, took 110-250 ms (H200 host, Python
3.12); each is a pause every running stream sees as one late token.

`settle_heap()`, called once the engine process is built (`settled_heap()` for a while only: a
benchmark's client during its measured run, whose own pauses would otherwise count as late tokens):
- collects, then freezes what survives (`gc.freeze`): the build's objects are never walked
  again, so a full collection only walks what serving has made since;
- raises the young threshold to `YOUNG_THRESHOLD`, above a step's transient objects, so young
  collections come when garbage really accumulates (a cycle leaked by some step) rather than at
  every step.

Measured on 20b at 256 streams (docs/benchmark-log.md, "The collector out of the stream"): both
together took each process from about 2,570 young collections a minute to 1; on each of three
machines they gave the lowest inter-token p99 (2.6-3.6x its median, against 3.2-4.4x with the
defaults) and 2-11% more tokens a second. Freezing alone, at the default threshold, made
serving more than twice slower (two machines, Python 3.12; cause not found), so the two go
together.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

YOUNG_THRESHOLD = 20_000  # tracked objects allocated (net) between young collections; CPython's default is 700


def settle_heap(young_threshold: int = YOUNG_THRESHOLD) -> int:
    """Collect, freeze the survivors and raise the young threshold (the older ones' stay).
    Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)
    return gc.get_freeze_count()


@contextlib.contextmanager
def settled_heap(young_threshold: int = YOUNG_THRESHOLD) -> Iterator[None]:
    """`settle_heap` for the block's duration; after it the frozen objects are collectable again
    and the threshold is what it was."""
    before = gc.get_threshold()
    settle_heap(young_threshold)
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
