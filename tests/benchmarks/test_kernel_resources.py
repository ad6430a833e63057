"""`benchmarks/kernel_resources.py` compiles the grouped MoE kernels for sm_90 without a GPU and
reads their register use and MMA issue from what ptxas produced. It runs as its own process:
kernels imported under the Triton interpreter (as the CPU tests import them) cannot compile."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS

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
    (small, wide) = [
        dict(zip(("registers", "spilled", "shared", "wgmma", "waits0", "waits"), map(int, r[5:]))) for r in rows
    ]
    for r in (small, wide):
        assert 0 < r["registers"] <= 255 and r["wgmma"] > 0  # Hopper's tensor-core MMA
        assert r["waits0"] + r["waits"] > 0
    # 64 tokens a block hold four times the accumulators of 16 and a wider activation tile.
    assert wide["shared"] > small["shared"] and wide["registers"] + wide["spilled"] / 4 > small["registers"]
