"""Every script in `benchmarks/` imports on a CPU machine: a module renamed or moved in the
tree breaks a script at its imports, which nothing else runs off the GPU."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark

SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))


def test_scripts_found():
    assert {"bench_attention", "bench_engine", "bench_moe"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run: the script's folder comes first
    assert load_benchmark(name).__file__ == str(BENCHMARKS / f"{name}.py")
