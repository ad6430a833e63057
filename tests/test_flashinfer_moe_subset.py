"""The flashinfer measurement tools, on CPU: the subset build's source rewriting
(`benchmarks/flashinfer_moe_subset.py`) and `bench_moe.py`'s tactic sweep."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_moe  # noqa: E402
import flashinfer_moe_subset as subset  # noqa: E402


def test_parse_tiles():
    assert subset.parse_tiles("64x16x128P, 128x64x256C") == {
        ("64", "16", "128", "Pingpong"), ("128", "64", "256", "Cooperative")}
    assert len(subset.parse_tiles(subset.DEFAULT_TILES)) == 15
    with pytest.raises(SystemExit, match="not MxNxK"):
        subset.parse_tiles("64x16x128")


LAUNCHER = """#include "moe_gemm_tma_ws_mixed_input_launcher.h"
#include "moe_gemm_tma_ws_mixed_input_prebuild.h"
template <typename T>
void sm90_generic_mixed_moe_gemm_kernelLauncher_impl(
    int inputs, size_t* workspace_size) {
  TLLM_LOG_DEBUG(__PRETTY_FUNCTION__);
  heavy_kernel_setup();
  return;
}

template <typename T>
void sm90_generic_mixed_moe_gemm_kernelLauncher(int inputs, size_t* workspace_size) {
  sm90_generic_mixed_moe_gemm_kernelLauncher_impl<T>(inputs, workspace_size);
}
"""


def test_stub_launcher_guards_only_the_kernel_body(tmp_path):
    source, target = tmp_path / "launcher.inl", tmp_path / "stub.inl"
    source.write_text(LAUNCHER)
    subset.stub_launcher(source, target)
    lines = target.read_text().split("\n")
    first = lines.index("#ifdef OSS_AGENT_STUB")
    assert lines[first - 1].strip() == "TLLM_LOG_DEBUG(__PRETTY_FUNCTION__);"
    assert "*workspace_size = 0; return;" in lines[first + 1] and "throw" in lines[first + 2]
    assert lines[first + 3] == "#else" and lines[first + 4].strip() == "heavy_kernel_setup();"
    assert lines[first + 6] == "#endif" and lines[first + 7] == "}"  # before the impl's closing brace
    assert lines.count("#endif") == 1  # the wrapper launcher is untouched
    launchers = "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/"
    assert f'#include "{launchers}moe_gemm_tma_ws_mixed_input_launcher.h"' in lines
    assert f'#include "{launchers}moe_gemm_tma_ws_mixed_input_prebuild.h"' in lines


class FakeBackend:
    profile_ids = None


def test_tactic_sweep_finds_the_fastest_built_pair(monkeypatch):
    """GEMM1 has 6 tactics (indices 0-5), GEMM2 4 (6-9); odd ones are not built. The sweep
    times GEMM1 with GEMM2's default, then GEMM2 with the fastest GEMM1, and restores None."""
    backend = FakeBackend()
    gemm1_us = {0: 50.0, 2: 30.0, 4: 40.0}
    gemm2_us = {6: 9.0, 8: 7.0}
    seen = []

    def fake_time_graph(forward, iters):
        g1, g2 = backend.profile_ids
        seen.append((g1, g2))
        if g1 >= 6:
            raise RuntimeError(f"Invalid gemm1 profile id: {g1}")
        if g2 >= 10:
            raise RuntimeError(f"Invalid gemm2 profile id: {g2}")
        if g1 not in gemm1_us or (g2 != -1 and g2 not in gemm2_us):
            raise RuntimeError("this tactic was not compiled")
        return (gemm1_us[g1] + (gemm2_us[g2] if g2 != -1 else 10.0)) * 1e-6

    monkeypatch.setattr(bench_moe, "graph_replay_seconds", fake_time_graph)
    ids, seconds, counts = bench_moe.sweep_flashinfer_tactics(backend, forward=None, iters=1)
    assert ids == [2, 8] and seconds == pytest.approx(37e-6)
    assert counts == "3/6 and 2/4 ran"
    assert backend.profile_ids is None
    assert seen[:7] == [(i, -1) for i in range(7)] and seen[7:] == [(2, j) for j in range(6, 11)]


def test_tactic_sweep_reports_when_nothing_runs(monkeypatch):
    backend = FakeBackend()

    def refuse(forward, iters):
        g1, _ = backend.profile_ids
        raise RuntimeError("Invalid gemm1 profile id" if g1 >= 3 else "not compiled")

    monkeypatch.setattr(bench_moe, "graph_replay_seconds", refuse)
    with pytest.raises(RuntimeError, match="no GEMM1 tactic ran"):
        bench_moe.sweep_flashinfer_tactics(backend, forward=None, iters=1)
    assert backend.profile_ids is None
