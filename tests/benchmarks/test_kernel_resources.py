"""`benchmarks/kernel_resources.py` compiles the grouped MoE kernels for sm_90 without a GPU and
reads their register use and MMA issue from what ptxas produced. It runs as its own process:
kernels imported under the Triton interpreter (as the CPU tests import them) cannot compile."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark

pytest.importorskip("triton")


def test_grouped_down_kernel_compiles_for_hopper_offline():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kernel_resources.py"), "--kernels", "down", "--block-m", "16,64"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    rows = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| down |")]
    assert [r[1] for r in rows] == ["16", "64"]
    assert [r[6] for r in rows] == ["False", "True"]  # narrow blocks from 32 tokens, as launched
    names = ("registers", "spilled", "shared", "wgmma", "waits0", "waits", "programs")
    (small, wide) = [dict(zip(names, map(int, r[7:]))) for r in rows]
    for r in (small, wide):
        assert 0 < r["registers"] <= 255 and r["wgmma"] > 0  # Hopper's tensor-core MMA
        assert r["waits0"] + r["waits"] > 0
        assert r["programs"] == resources_module().programs_per_sm(r["registers"], r["shared"], 4)
    # 64 tokens a block hold four times the accumulators of 16 and a wider activation tile, so
    # fewer programs fit on a multiprocessor.
    assert wide["shared"] > small["shared"] and wide["registers"] + wide["spilled"] / 4 > small["registers"]
    assert wide["programs"] < small["programs"]


def resources_module():
    return load_benchmark("kernel_resources")


def test_programs_per_sm_matches_what_ncu_reported_on_an_h200():
    programs_per_sm = resources_module().programs_per_sm
    # ncu's block limits for the gate_up kernel at 64-token blocks (139 registers, 66,560 bytes of
    # shared memory, 4 warps): 3 by registers, 3 by shared memory.
    assert programs_per_sm(139, 66560, 4) == 3
    assert programs_per_sm(128, 41472, 4) == 4  # 128 registers: four programs' worth exactly
    assert programs_per_sm(129, 0, 4) == 3  # registers are given out 8 a thread at a time
    assert programs_per_sm(32, 0, 4) == 16  # and no more than 64 warps
    assert programs_per_sm(32, 116 * 1024, 4) == 1


def test_the_offline_compile_carries_the_launch_alignment_hints():
    kr = resources_module()
    fn, signature = kr.SIGNATURES["gate_up"]
    hinted = {fn.arg_names[i] for (i,) in kr.launch_attrs(fn, signature)}
    assert {"x_ptr", "w_ptr", "act_ptr", "H", "I", "E0", "E_LOCAL", "stride_x"} <= hinted
    assert not {"num_tiles", "num_pairs", "limit"} & hinted  # 45 and 23 tiles at gpt-oss's shapes
