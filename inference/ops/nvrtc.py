"""CUDA C++ kernels compiled at run time with NVRTC, and launched with or without programmatic
dependent launch (`inference/ops/dependent_launch.py`).

Triton covers almost every kernel here. The exception is a kernel that needs what Triton does
not express: warp-specialised producers and consumers around `cp.async.bulk` copies and
mbarriers, or a grid-wide barrier (`inference/ops/moe/persistent.py`). NVRTC ships with the
CUDA builds of torch (the `nvidia-cuda-nvrtc` wheel it depends on), so such a kernel needs no
compiler at install time. Where NVRTC or a GPU is missing, `available()` is False and callers
keep their Triton path.

The binding is a few ctypes calls into libnvrtc and the driver (libcuda), which torch has
loaded already. torch's own helpers for this are private and change between releases.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import sys
from dataclasses import dataclass

import torch

from inference.device import cuda_index

log = logging.getLogger(__name__)

_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: a 4-byte id, padding to 8, then a 64-byte value union.
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


@functools.lru_cache(maxsize=None)
def _nvrtc() -> ctypes.CDLL | None:
    """libnvrtc of torch's CUDA major version (loaded by torch, or from its `nvidia-cuda-nvrtc`
    wheel); on a CPU-only build of torch, the newest NVRTC wheel installed (the tests compile the
    kernels offline with it)."""
    major = (torch.version.cuda or "").split(".")[0]
    wheels = [f for p in sys.path for f in glob.glob(os.path.join(p, "nvidia", "*", "lib", "libnvrtc.so.*[0-9]"))]
    if major:
        names = [f"libnvrtc.so.{major}", *[f for f in wheels if f.endswith(f".so.{major}")]]
    else:
        names = sorted(wheels, key=lambda f: int(f.rsplit(".", 1)[1]), reverse=True)
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def available() -> bool:
    """Whether kernels can be compiled and launched here: a CUDA GPU, NVRTC and the driver."""
    return (
        torch.cuda.is_available() and torch.version.cuda is not None and _nvrtc() is not None and _driver() is not None
    )


def _check_driver(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(message.value or b'?').decode()})")


def compile_to_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """NVRTC: CUDA C++ source -> a CUBIN for `arch` (such as "sm_90"). Raises RuntimeError with
    the compiler's log on failure. Needs no GPU."""
    nvrtc = _nvrtc()
    if nvrtc is None:
        raise RuntimeError("NVRTC (libnvrtc) is not installed")

    def check(result: int, what: str) -> None:
        if result != 0:
            nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(result).decode()}")

    prog = ctypes.c_void_p()
    check(
        nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *options]
        array = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), array)
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC could not compile {name}:\n{text.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


@dataclass
class CudaKernel:
    """One loaded `extern "C"` kernel of a CUBIN, on the device that was current at load."""

    name: str
    function: ctypes.c_void_p
    module: ctypes.c_void_p
    dynamic_shared_bytes: int = 0

    def launch(self, grid: int, block: int, shared_bytes: int, args: list, dependent: bool) -> None:
        """Launch on torch's current stream (capturable in a CUDA graph). args: ctypes values
        in the kernel's parameter order (c_void_p for pointers). dependent: launch with
        programmatic stream serialization, so that the kernel is placed while the one before
        it finishes; it must execute `griddepcontrol.wait` before reading that one's output."""
        if shared_bytes > self.dynamic_shared_bytes:
            _check_driver(
                _driver().cuFuncSetAttribute(
                    self.function, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes
                ),
                f"{self.name}: setting {shared_bytes} bytes of shared memory",
            )
            self.dynamic_shared_bytes = shared_bytes
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        attribute = _LaunchAttribute()
        attribute.id = _LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value = (1).to_bytes(4, "little") + bytes(60)
        config = _LaunchConfig(
            grid,
            1,
            1,
            block,
            1,
            1,
            shared_bytes,
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            ctypes.pointer(attribute) if dependent else None,
            1 if dependent else 0,
        )
        _check_driver(
            _driver().cuLaunchKernelEx(ctypes.byref(config), self.function, params, None), f"launching {self.name}"
        )


_loaded: dict[tuple, CudaKernel] = {}


def load_kernel(source: str, name: str, device: torch.device, options: tuple[str, ...] = ()) -> CudaKernel:
    """Compile (once per source, device and options) and load kernel `name` of `source` for
    `device`'s architecture."""
    index = cuda_index(device)
    key = (source, name, index, options)
    kernel = _loaded.get(key)
    if kernel is None:
        major, minor = torch.cuda.get_device_capability(index)
        cubin = compile_to_cubin(source, name, f"sm_{major}{minor}", options)
        driver = _driver()
        with torch.cuda.device(index):
            torch.cuda.init()
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check_driver(driver.cuModuleLoadData(ctypes.byref(module), cubin), f"loading {name}")
            _check_driver(driver.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), f"finding {name}")
        kernel = _loaded[key] = CudaKernel(name, function, module)
        log.debug("compiled %s for sm_%d%d (%d bytes of CUBIN)", name, major, minor, len(cubin))
    return kernel
