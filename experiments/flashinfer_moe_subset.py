"""Build a subset of flashinfer's SM90 fused-MoE module: only the bf16 x MXFP4 path, few tiles.

flashinfer JIT-compiles `fused_moe_90` from ~250 sources holding ~1,300 CUTLASS kernels (every
activation x weight type pair, 184 tile/cluster/schedule variants of each); that takes longer
than is practical on a benchmark machine (tens of minutes). gpt-oss needs one pair, bf16 activations x MXFP4 weights, so this
script builds that and nothing else, on any machine with nvcc and flashinfer's sources (a GPU is
not needed; 2 cores took 37 minutes):

  - the runner, its GEMM dispatch and the binding, with only the bf16 x MXFP4 runner
    instantiated (`CutlassMoeFCRunner<bf16, Fp4Type>`);
  - the chosen mixed-input GEMM tiles (`--tiles`, cluster 1x1x1) compiled for real; the other
    bf16 x MXFP4 variants compiled as stubs that report no workspace and raise "not compiled"
    when run, so flashinfer's tactic list stays whole and a missing tactic is an error, not a
    crash;
  - the binding still refers to the runners of other type pairs through their vtables: those
    entries are linked to a function that aborts (they are never called for bf16 x MXFP4).

The result is one shared library that flashinfer's Python API can use in place of its JIT
module (`use_prebuilt`; `bench_moe.py --flashinfer-module PATH`). Tied to the flashinfer release
it was written against (0.7.2.post1): a release that renames these sources needs this updated.

    python3 experiments/flashinfer_moe_subset.py --out /tmp/fused_moe_subset --jobs 16
    python3 benchmarks/bench_moe.py --backends triton,flashinfer --flashinfer-tactics \\
        --flashinfer-module /tmp/fused_moe_subset/fused_moe_90.so
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

# (M, N, K, mainloop schedule) of the tiles compiled for real; the first is flashinfer's
# default tactic, 128x64x256 cooperative is the one it sizes the GEMM workspace with.
DEFAULT_TILES = (
    "64x16x128P,64x16x256P,64x32x128P,64x32x256P,64x64x128P,64x64x256P,64x128x128P,"
    "128x16x128C,128x16x256C,128x32x128C,128x64x128C,128x64x256C,128x128x128C,128x128x128P,128x256x128C"
)
LAUNCHER = "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/moe_gemm_tma_ws_mixed_input_launcher.inl"
INSTANTIATION = re.compile(r"template void sm90_generic_mixed_moe_gemm_kernelLauncher<.*?;\n", re.S)
SHAPE = re.compile(
    r"Shape<cute::Int<(\d+)>, cute::Int<(\d+)>, cute::Int<(\d+)>>, "
    r"cute::Shape<cute::Int<(\d+)>, cute::Int<(\d+)>, cute::Int<(\d+)>>, "
    r"cutlass::gemm::KernelTmaWarpSpecialized(Cooperative|Pingpong)"
)
BF16_MXFP4 = "template void sm90_generic_mixed_moe_gemm_kernelLauncher<__nv_bfloat16, SafeFP4,"
ABORT_STUB = """#include <stdio.h>
#include <stdlib.h>
void oss_agent_unbuilt_runner(void) {
  fprintf(stderr, "flashinfer_moe_subset: a MoE runner of another type pair was called\\n");
  abort();
}
"""


def parse_tiles(text: str) -> set[tuple[str, str, str, str]]:
    """ "64x16x128P,128x64x256C" -> {("64", "16", "128", "Pingpong"), ...}."""
    tiles = set()
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)x(\d+)x(\d+)([CP])", item.strip())
        if not match:
            raise SystemExit(f"--tiles: {item!r} is not MxNxK followed by C (cooperative) or P (pingpong)")
        m, n, k, schedule = match.groups()
        tiles.add((m, n, k, "Cooperative" if schedule == "C" else "Pingpong"))
    return tiles


def stub_launcher(source: Path, target: Path) -> None:
    """A copy of the mixed-input launcher whose body, under OSS_AGENT_STUB, only answers
    workspace queries (0 bytes) and otherwise raises."""
    lines = source.read_text().split("\n")
    start = next(i for i, line in enumerate(lines) if "void sm90_generic_mixed_moe_gemm_kernelLauncher_impl(" in line)
    first = next(i for i in range(start, len(lines)) if "TLLM_LOG_DEBUG(__PRETTY_FUNCTION__);" in lines[i])
    end = next(i for i in range(first, len(lines)) if lines[i] == "}")
    stub = [
        "#ifdef OSS_AGENT_STUB",
        "  if (workspace_size != nullptr) { *workspace_size = 0; return; }",
        '  throw std::runtime_error("[flashinfer_moe_subset] this tactic was not compiled");',
        "#else",
    ]
    text = "\n".join(lines[: first + 1] + stub + lines[first + 1 : end] + ["#endif"] + lines[end:])
    here = "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/"
    for header in ("moe_gemm_tma_ws_mixed_input_launcher.h", "moe_gemm_tma_ws_mixed_input_prebuild.h"):
        text = text.replace(f'#include "{header}"', f'#include "{here}{header}"')  # no longer beside it
    target.write_text(text)


def write_sources(out: Path, generated: Path, csrc: Path, tiles) -> tuple[list[Path], list[Path]]:
    """The generated bf16 x MXFP4 instantiations, split into real ones (one file each, for
    parallel builds) and stubs (two files); and the trimmed runner instantiation."""
    src = out / "src"
    src.mkdir(parents=True, exist_ok=True)
    keep, stubs, header = [], [], None
    for path in sorted(generated.glob("gemm_grouped/90/*Mixed*.generated.cu")):
        text = path.read_text()
        header = header or text.split("template void")[0]
        for inst in INSTANTIATION.findall(text):
            if not inst.startswith(BF16_MXFP4):
                continue
            m, n, k, cm, cn, ck, schedule = SHAPE.search(inst).groups()
            (keep if (cm, cn, ck) == ("1", "1", "1") and (m, n, k, schedule) in tiles else stubs).append(inst)
    if len(keep) != len(tiles):
        raise SystemExit(f"found {len(keep)} of the {len(tiles)} requested tiles among flashinfer's instantiations")
    tail = "\n}\n}\n}\n"
    stub_launcher(csrc / "nv_internal" / LAUNCHER, src / "mixed_launcher_stub.inl")
    stub_header = header.replace(
        f'#include "{LAUNCHER}"', f'#define OSS_AGENT_STUB 1\n#include "{src / "mixed_launcher_stub.inl"}"'
    )
    real = []
    for i, inst in enumerate(keep):
        real.append(src / f"tile_{i}.cu")
        real[-1].write_text(header + inst + tail)
    stub_files = []
    half = (len(stubs) + 1) // 2
    for i in range(2):
        stub_files.append(src / f"stubs_{i}.cu")
        stub_files[-1].write_text(stub_header + "".join(stubs[i * half : (i + 1) * half]) + tail)
    runner = (csrc / "fused_moe/cutlass_backend/cutlass_fused_moe_instantiation.cu").read_text()
    runner = runner.split("namespace tensorrt_llm::kernels::cutlass_kernels {")[0] + (
        "namespace tensorrt_llm::kernels::cutlass_kernels {\n"
        "template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;\n"
        "INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);\n"
        "}  // namespace tensorrt_llm::kernels::cutlass_kernels\n"
    )
    (src / "runner_bf16_mxfp4.cu").write_text(runner)
    return real + stub_files, [src / "runner_bf16_mxfp4.cu"]


def write_ninja(
    out: Path, spec_ninja: Path, csrc: Path, gemm_sources, runner_sources, includes, library_dirs
) -> tuple[Path, int]:
    """build.ninja from flashinfer's own (its variables and rules), over this subset's sources."""
    rules = spec_ninja.read_text().split("\nbuild ")[0]
    extra = "".join(f" -isystem {d}" for d in includes)
    rules = re.sub(r"^(cuda_cflags|cflags) = \$common_cflags", lambda m: m.group(0) + extra, rules, flags=re.M)
    # Link against the toolkit's libcuda stub, or else an empty one with the driver's soname;
    # nvrtc only serves flashinfer's DeepGEMM JIT, unused here, so its calls stay unresolved.
    (out / "stubs").mkdir(exist_ok=True)
    subprocess.run(
        ["cc", "-shared", "-o", str(out / "stubs/libcuda.so"), "-Wl,-soname,libcuda.so.1", "-x", "c", "/dev/null"],
        check=True,
    )
    libs = "".join(f" -L{d}" for d in library_dirs)
    rules = rules.replace("-lcuda $\n    -lnvrtc", f"-lcuda{libs} -L{out / 'stubs'}")
    if f"-L{out / 'stubs'}" not in rules:
        raise SystemExit("flashinfer's link flags changed; update write_ninja")
    backend, kernels = csrc / "fused_moe/cutlass_backend", csrc / "nv_internal/tensorrt_llm/kernels"
    common = csrc / "nv_internal/cpp/common"
    cuda = [
        *gemm_sources,
        backend / "flashinfer_cutlass_fused_moe_binding.cu",
        backend / "deepgemm_jit_setup.cu",
        kernels / "cutlass_kernels/moe_gemm/moe_gemm_kernels_bf16_fp4.cu",
        kernels / "cutlass_kernels/moe_gemm/moe_gemm_tma_warp_specialized_input.cu",
        kernels / "cutlass_kernels/moe_gemm/moe_gemm_mixed_utils.cu",
        kernels / "preQuantScaleKernel.cu",
        common / "memoryUtils.cu",
    ]
    cxx = [common / f"{name}.cpp" for name in ("envUtils", "logger", "stringUtils", "tllmException")]
    cxx += [kernels / "cutlass_kernels/cutlass_heuristic.cpp", kernels / "lora/lora.cpp"]
    lines, objects = [], []
    obj = out / "obj"
    for rule, sources in (("cuda_compile", cuda), ("cuda_compile_runner", runner_sources), ("compile", cxx)):
        for source in sources:
            objects.append(obj / f"{source.parent.name}_{source.name}.o")
            lines.append(f"build {objects[-1]}: {rule} {source}")
    rules += (
        "\nrule cuda_compile_runner\n  command = $nvcc_launcher $nvcc --generate-dependencies-with-compile "
        f"-MF $out.d $cuda_cflags -I{backend} -c $in -o $out $cuda_post_cflags\n  depfile = $out.d\n  deps = gcc\n"
    )
    ninja = out / "build.ninja"
    ninja.write_text(
        rules
        + "\n"
        + "\n".join(lines)
        + f"\n\nbuild {out / 'objects.stamp'}: phony "
        + " ".join(map(str, objects))
        + "\n"
    )
    return ninja, len(objects)


def link(out: Path, ninja: Path) -> Path:
    """Link the objects; then point every eagerly bound, undefined runner symbol (vtable
    entries of the other type pairs) at an aborting stub and link again."""
    text = ninja.read_text()
    objects = [
        line.split(": ")[0][len("build ") :]
        for line in text.splitlines()
        if line.startswith("build ") and ".o: " in line
    ]
    ldflags = re.search(r"\nldflags = (.*?)\n\n", text, re.S).group(1).replace("$\n", " ")
    ldflags = ldflags.replace("$cuda_home", re.search(r"\ncuda_home = (\S+)", text).group(1))
    stub_c = out / "abort_stub.c"
    stub_c.write_text(ABORT_STUB)
    subprocess.run(["cc", "-c", "-fPIC", "-O2", "-o", str(out / "abort_stub.o"), str(stub_c)], check=True)
    library = out / "fused_moe_90.so"

    def run_link(defsyms: list[str]) -> None:
        subprocess.run(
            [
                "c++",
                *objects,
                str(out / "abort_stub.o"),
                *ldflags.split(),
                *[f"-Wl,--defsym={s}=oss_agent_unbuilt_runner" for s in defsyms],
                "-o",
                str(library),
            ],
            check=True,
        )

    run_link([])
    undefined = set(
        subprocess.run(
            ["nm", "-D", "--undefined-only", str(library)], check=True, capture_output=True, text=True
        ).stdout.split()
    )
    relocations = subprocess.run(["readelf", "-rW", str(library)], check=True, capture_output=True, text=True).stdout
    eager = set()
    for line in relocations.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[2].startswith("R_X86_64") and fields[2] != "R_X86_64_JUMP_SLOT":
            symbol = fields[4].split("@")[0]
            if symbol in undefined and "CutlassMoeFCRunner" in symbol:
                eager.add(symbol)
    if eager:
        run_link(sorted(eager))
    print(
        f"linked {library} ({library.stat().st_size / 1e6:.1f} MB; {len(eager)} runner symbols of other type "
        "pairs point at an aborting stub)",
        flush=True,
    )
    return library


class PrebuiltModule:
    """Stands in for one of flashinfer's JIT module specs: `build_and_load` loads a library
    built beforehand (this script's output, or flashinfer's own build of another module)."""

    def __init__(self, library: str) -> None:
        self.library = library

    def build_and_load(self):
        import tvm_ffi

        return tvm_ffi.load_module(self.library)


def use_prebuilt(library: str) -> None:
    """Make flashinfer load `library` (this script's output) as its SM90 fused-MoE module
    instead of JIT-building the full one. Call before the first fused-MoE call."""
    import flashinfer.fused_moe.core as core

    core.gen_cutlass_fused_moe_sm90_module = lambda use_fast_build=False: PrebuiltModule(library)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="build folder (sources, objects, the library)")
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="MxNxK plus C/P (cooperative/pingpong), comma-separated")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--include",
        action="append",
        default=[],
        help="extra header folder (e.g. curand's and nvrtc's, where the CUDA toolkit lacks them)",
    )
    ap.add_argument("--lib", action="append", default=[], help="extra library folder (e.g. libcudart's)")
    args = ap.parse_args()
    args.out = args.out.resolve()  # ninja runs inside it (-C), and its paths must not be relative
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    spec = gen_cutlass_fused_moe_sm90_module()  # also writes flashinfer's generated instantiations
    spec.write_ninja()
    generated = jit_env.FLASHINFER_GEN_SRC_DIR / "cutlass_instantiations/90"
    csrc = Path(jit_env.FLASHINFER_CSRC_DIR)
    args.out.mkdir(parents=True, exist_ok=True)
    gemm_sources, runner_sources = write_sources(args.out, generated, csrc, parse_tiles(args.tiles))
    ninja, count = write_ninja(
        args.out, Path(spec.ninja_path), csrc, gemm_sources, runner_sources, args.include, args.lib
    )
    print(f"building {count} objects with {args.jobs} jobs (ninja's [done/total] below)", flush=True)
    subprocess.run(
        ["ninja", "-C", str(args.out), "-f", str(ninja), "-j", str(args.jobs), str(args.out / "objects.stamp")],
        check=True,
    )  # -C: ninja's log and dependency files go to the build folder
    link(args.out, ninja)


if __name__ == "__main__":
    sys.exit(main())
