"""Where the Triton kernel tests run: on a CUDA GPU, or under Triton's interpreter on CPU.

Import this before any kernel module: without CUDA it sets TRITON_INTERPRET=1 first, because
`triton.jit` decides at decoration time whether a kernel is interpreted. If triton was already
imported in this process without it (another test module got there first), the kernels cannot be
interpreted here; each kernel test file then runs its Triton tests in a fresh process instead
(`run_in_fresh_interpreter`).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


def _interpreter_ready() -> bool:
    """Triton's own library functions (tl.max, tl.sum, ...) are decorated when triton is first
    imported: interpreted only if TRITON_INTERPRET was set by then."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.max, InterpretedFunction)


# Where the kernels can run in this process: a GPU, or a correctly set-up interpreter.
IN_PROCESS = HAVE_TRITON and (CUDA or _interpreter_ready())
needs_triton = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton is not installed"
    if not HAVE_TRITON
    else "triton was imported before TRITON_INTERPRET=1; test_triton_in_fresh_interpreter runs these",
)
gpu_only = pytest.mark.gpu  # (GPU machines have triton: the `gpu` extra)
fresh_process_only = pytest.mark.skipif(
    not HAVE_TRITON or CUDA or IN_PROCESS, reason="the Triton tests run in this process"
)
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32


def kernel_module(name: str, kernel: str):
    """Import module `name`, reloaded (on CPU) if its `kernel` was decorated outside interpreter mode."""
    module = importlib.import_module(name)
    if not CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(getattr(module, kernel), InterpretedFunction):
            module = importlib.reload(module)
    return module


def run_in_fresh_interpreter(test_file: str, marks: str = "not slow") -> None:
    """Run `test_file`'s Triton tests (named `*triton_*`) selected by the marker expression
    `marks` in a new interpreter-mode process and require that they ran and passed (the default
    run takes the quick ones; a test marked slow runs the slow ones with `marks="slow"`)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        test_file,
        "-k",
        "triton_ and not fresh",
        "-m",
        marks,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-500:]
