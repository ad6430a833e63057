"""The decode attention kernel's SASS, compiled offline for sm_90 (no GPU needed): instruction
counts by opcode for a bf16 and an fp8 cache, as a serving batch launches it (gpt-oss shapes,
64-key steps, the step's new K/V folded in, 3 stages).

    python3 experiments/decode_attention_sass.py [--warps 1,2]

Used for docs/benchmark-log.md, "An fp8 KV cache": the fp8 kernel reads its MMA operands from
shared memory a byte at a time (LDS) and widens them there, where bf16 uses ldmatrix (LDSM).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.ops.attention import triton as attention  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
POINTERS = dict(Sinks="*fp32", BlockTables="*i32", ContextLens="*i32", PartAcc="*fp32", PartMax="*fp32")
POINTERS |= dict(PartSum="*fp32", Positions="*i64", CosSin="*fp32", Slots="*i64")


def sass(cache: str, warps: int) -> str:
    """nvdisasm's listing of `_decode_kernel` for a cache of `cache` ("*bf16" or "*fp8e4nv")."""
    fn = attention._decode_kernel
    pointers = POINTERS | dict(Q="*bf16", Out="*bf16", KNew="*bf16", VNew="*bf16", K=cache, V=cache)
    const = dict(NUM_Q_HEADS=64, G=8, BLOCK_G=16, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_N=64, SLIDING=False)
    const |= dict(SPLIT=False, NEW_KV=True, KV_FP8=cache == "*fp8e4nv", PDL=False)
    const |= {k: True for k in fn.arg_names if k == "ASM"}  # (a branch's own flags, where present)
    signature = {}
    for name in fn.arg_names:
        kind = pointers.get(name) or ("constexpr" if name in const else "fp32" if name == "qk_scale" else "i32")
        signature[name] = kind
    # As a launch specialises it: 16-byte-aligned pointers, strides divisible by 16.
    aligned = [k for k, t in signature.items() if t.startswith("*") or k.startswith("stride")]
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
        attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        Path(path).write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(NVDISASM), "-c", path], capture_output=True, text=True, check=True).stdout


def opcodes(listing: str) -> collections.Counter:
    ops = collections.Counter()
    for line in listing.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warps", default="1,2")
    args = ap.parse_args()
    print("| cache | warps | instructions | LDS | LDSM | STS | F2FP | HMMA | LDGSTS | IMAD |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cache in ("*bf16", "*fp8e4nv"):
        for warps in (int(w) for w in args.warps.split(",")):
            ops = opcodes(sass(cache, warps))
            cols = [ops[k] for k in ("LDS", "LDSM", "STS", "F2FP", "HMMA", "LDGSTS", "IMAD")]
            print(f"| {cache[1:]} | {warps} | {sum(ops.values())} | " + " | ".join(map(str, cols)) + " |")


if __name__ == "__main__":
    main()
