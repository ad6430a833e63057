"""`DecodeGraphRunner`'s choice of graphs, which needs no GPU: which batch sizes it captures for a
largest batch, and which graphs carry the count of real tokens."""

from __future__ import annotations

from inference.runner.cuda_graphs import DEFAULT_BATCH_SIZES, DecodeGraphRunner


def runner(max_batch=None, batch_sizes=DEFAULT_BATCH_SIZES, tokens_per_seq=(1,), max_verify_batch=32):
    return DecodeGraphRunner(
        None,
        [],
        max_pages=4,
        max_context=64,
        batch_sizes=batch_sizes,
        max_batch=max_batch,
        tokens_per_seq=tokens_per_seq,
        max_verify_batch=max_verify_batch,
    )


def test_sizes_reach_the_first_graph_that_holds_the_largest_batch():
    assert runner(max_batch=5).batch_sizes == (1, 2, 4, 8)  # a batch of 5 replays the graph of 8
    assert runner(max_batch=8).batch_sizes == (1, 2, 4, 8)
    assert runner(max_batch=1).batch_sizes == (1,)
    assert runner(max_batch=100).batch_sizes[-1] == 128
    assert runner(max_batch=10_000).batch_sizes == DEFAULT_BATCH_SIZES  # past the largest: all of them
    assert runner().batch_sizes == DEFAULT_BATCH_SIZES


def test_only_graphs_that_run_smaller_batches_carry_the_count():
    r = runner(tokens_per_seq=(1, 3), max_verify_batch=8)
    assert [b for b in r.sizes[1] if r.pads(b)] == [b for b in DEFAULT_BATCH_SIZES if b >= 4]
    assert not r.pads(1) and not r.pads(2) and r.pads(4)
    assert r.sizes[3] == (1, 2, 4, 8) and [b for b in r.sizes[3] if r.pads(b, 3)] == [4, 8]
    assert not runner(batch_sizes=(1, 2, 3, 4)).pads(3)  # consecutive sizes never pad
