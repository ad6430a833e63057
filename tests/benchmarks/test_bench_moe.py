"""`benchmarks/bench_moe.py --variant`: MoEKernelConfig fields from the command line, typed."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark


@pytest.fixture
def bench_moe(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its helpers sit beside it
    return load_benchmark("bench_moe")


def test_variant_fields_take_their_types(bench_moe):
    parsed = bench_moe.parse_variant("narrow_blocks=0,block_m=64,decode_max_pairs_per_expert=None,maxnreg=128")
    assert parsed == {"narrow_blocks": False, "block_m": 64, "decode_max_pairs_per_expert": None, "maxnreg": 128}
    assert parsed["narrow_blocks"] is False and isinstance(parsed["block_m"], int)
    assert bench_moe.parse_variant("narrow_blocks=1") == {"narrow_blocks": True}
    assert bench_moe.parse_variant("decode_max_pairs_per_expert=1.5") == {"decode_max_pairs_per_expert": 1.5}
    config = bench_moe.MoEKernelConfig(**parsed)  # what the benchmark builds from it
    assert config.block_m == 64 and not config.narrow_blocks


def test_unknown_field_is_refused(bench_moe):
    with pytest.raises(argparse.ArgumentTypeError, match="no field 'narrow'"):
        bench_moe.parse_variant("narrow=1")
