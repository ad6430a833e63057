"""What a Triton kernel costs the GPU's registers, compiled offline: no GPU needed.
(`cubin_usage` reads any CUBIN's, such as the NVRTC-compiled kernels'.)

Compiles the grouped MoE kernels (`inference/ops/moe/triton.py`) for an sm_90 target with the
ptxas that ships with triton, and prints per launch shape the registers a thread, the bytes it
spills to local memory, the static shared memory, and how its tensor-core MMAs are issued:
`wgmma` instructions and the `wgmma.wait_group` waits between them (a wait of 0 right after
each group means every MMA's latency sits on the warp's critical path, with nothing of the
next tile's dequantisation overlapping it), and how many programs a multiprocessor holds.

The kernels are compiled as a launch specialises them: pointers 16-byte aligned and the integer
arguments that are multiples of 16 at gpt-oss's shapes (H = I = 2880, all 32 of 20b's experts)
marked so. Without those hints the compiler cannot vectorise or pipeline the loads, and the
registers and shared memory it reports are not those of the kernels that run.

    python benchmarks/kernel_resources.py                            # MoEKernelConfig's shapes
    python benchmarks/kernel_resources.py --block-m 32,64 --stages 2,3 --warps 4,8
    python benchmarks/kernel_resources.py --maxnreg 128                # as MoEKernelConfig.maxnreg
    python benchmarks/kernel_resources.py --narrow 0,1                 # without / with narrow blocks
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from inference.ops.moe import triton as moe  # noqa: E402

_SHARED = dict(sorted_ptr="*i32", block_expert_ptr="*i32", w_ptr="*u8", s_ptr="*i32", b_ptr="*fp32")
_INTS = ("H", "I", "E0", "E_LOCAL", "num_tiles", "num_pairs")
_CONST = ("TOP_K", "BLOCK_M", "BLOCK_N", "LARGE_SCALES", "PACKED", "OPERAND", "NARROW", "PDL")
SIGNATURES = {
    "gate_up": (
        moe._grouped_gate_up_kernel,
        {"x_ptr": "*bf16", **_SHARED, "act_ptr": "*bf16", **dict.fromkeys(_INTS, "i32"), "stride_x": "i32"}
        | {"limit": "fp32", "alpha": "fp32"},
    ),
    "down": (
        moe._grouped_down_kernel,
        {"act_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "gates_ptr": "*fp32"}
        | {"w_ptr": "*u8", "s_ptr": "*i32", "b_ptr": "*fp32", "out_ptr": "*fp32", **dict.fromkeys(_INTS, "i32")},
    ),
}


def cubin_usage(cubin: bytes) -> dict[str, int]:
    """cuobjdump's resource usage of a CUBIN's (first) kernel, with the cuobjdump in the triton
    wheel: {"REG": registers a thread, "STACK": bytes spilled, "SHARED": static shared bytes,
    "LOCAL": local memory bytes}."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernel_resources_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True, check=True)
    finally:
        path.unlink()
    return {
        name: int(re.search(rf"{name}:(\d+)", usage.stdout).group(1)) for name in ("REG", "STACK", "SHARED", "LOCAL")
    }


# The integer arguments' values in a 20b layer: a launch marks those divisible by 16 as such
# (Triton's specialisation), and so does the offline compile.
EXAMPLE_INTS = dict(H=2880, I=2880, E0=0, E_LOCAL=32, num_tiles=45, num_pairs=23, stride_x=2880)
SM90_REGISTERS = 65536  # a multiprocessor's registers, shared memory and warps
SM90_SHARED = 233472
SM90_WARPS = 64
RESERVED_SHARED = 1024  # the driver's shared memory per program


def launch_attrs(fn, signature: dict[str, str]) -> dict:
    """`ASTSource` attrs as a launch of `fn` at gpt-oss's shapes specialises it: tt.divisibility
    16 on every pointer (torch's allocations are 256-byte aligned) and every integer in
    EXAMPLE_INTS divisible by 16."""
    aligned = [k for k, t in signature.items() if t.startswith("*") or EXAMPLE_INTS.get(k, 1) % 16 == 0]
    return {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned}


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs an sm_90 multiprocessor holds at once: registers are given out per warp in units
    of 256 (a thread's count rounded up to 8), shared memory per program plus the driver's 1 KB."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90_REGISTERS // (per_warp * warps)
    return min(by_registers, SM90_SHARED // (shared + RESERVED_SHARED), SM90_WARPS // warps)


def resources(
    kernel: str,
    block_m: int,
    block_n: int,
    warps: int,
    stages: int,
    arch: int = 90,
    maxnreg: int | None = None,
    narrow: bool | None = None,
) -> dict:
    """Compile one grouped MoE kernel (bf16 activations, packed MXFP4 dequantisation, top-4) for
    sm_`arch` as a launch specialises it; {registers, spill_bytes, shared_bytes, wgmma, waits_0,
    waits_other, programs_per_sm}. narrow: the half-width branch compiled too (None: as a launch
    decides, `MoEKernelConfig.narrow_blocks` for blocks of 32 or more)."""
    fn, signature = SIGNATURES[kernel]
    if narrow is None:
        narrow = moe.DEFAULT_CONFIG.narrow_blocks and block_m >= 32
    const = dict(TOP_K=4, BLOCK_M=block_m, BLOCK_N=block_n, LARGE_SCALES=False, PACKED=True, OPERAND=tl.bfloat16)
    const |= dict(NARROW=narrow, PDL=False)
    src = ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(_CONST, "constexpr")},
        constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
        attrs=launch_attrs(fn, signature),
    )
    options = dict(num_warps=warps, num_stages=stages) | ({"maxnreg": maxnreg} if maxnreg else {})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = compiled.asm["ptx"]
    usage = cubin_usage(compiled.asm["cubin"])
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
    return {
        "narrow": narrow,
        "registers": usage["REG"],
        "spill_bytes": usage["STACK"],
        "shared_bytes": compiled.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "waits_0": waits.count("0"),
        "waits_other": len(waits) - waits.count("0"),
        "programs_per_sm": programs_per_sm(usage["REG"], compiled.metadata.shared, warps),
    }


def main() -> None:
    cfg = moe.DEFAULT_CONFIG
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="gate_up,down")
    ap.add_argument("--block-m", type=ints, default=[16, 32, 64, 128], help="tokens a block")
    ap.add_argument("--block-n", type=ints, default=None, help="weight rows a program (default: the config's)")
    ap.add_argument("--warps", type=ints, default=[cfg.warps])
    ap.add_argument("--stages", type=ints, default=[cfg.stages])
    ap.add_argument("--maxnreg", type=ints, default=[0], help="register caps a thread (0: none)")
    ap.add_argument("--narrow", type=ints, default=None, help="0, 1: the half-width branch (default: as launched)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, compiled offline\n")
    print(
        "| kernel | BLOCK_M | BLOCK_N | warps | stages | maxnreg | narrow | registers | spilled bytes | shared bytes | wgmma "
        "| waits of 0 | other waits | programs a multiprocessor |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kernel in args.kernels.split(","):
        block_ns = args.block_n or [cfg.block_n if kernel == "gate_up" else cfg.down_block_n]
        narrows = [None] if args.narrow is None else [bool(v) for v in args.narrow]
        shapes = itertools.product(args.block_m, block_ns, args.warps, args.stages, args.maxnreg, narrows)
        for m, n, w, s, cap, narrow in shapes:
            r = resources(kernel, m, n, w, s, maxnreg=cap or None, narrow=narrow)
            print(
                f"| {kernel} | {m} | {n} | {w} | {s} | {cap or '-'} | {r['narrow']} | {r['registers']} | {r['spill_bytes']} | "
                f"{r['shared_bytes']} | {r['wgmma']} | {r['waits_0']} | {r['waits_other']} | {r['programs_per_sm']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
