"""Build and load the C++ kernels (csrc/) once per machine, and say where they apply (`device.kernels`).

Decoding multiplies a handful of activation rows by every weight matrix, so its speed is how fast
the weights stream from memory. On CPU the library paths fall well short of that for these
matrix-vector products (measured on the 121 matrices of SmolLM2-135M, 2 threads: F.linear fp32
13.5 GB/s, oneDNN-prepacked 17.3, this kernel 22.9), so inferlab builds its own AVX2 kernels on first
use and caches the build: csrc/gemv.h (fp32, bf16, int8 and int4 weights, one pass over each row;
gemv.py), csrc/attention.h (one query per sequence through block tables; attention.py) and
csrc/decode_step.cpp (the whole decode step; fused_decode.py). Nothing here runs at import: the build
happens on the first call that asks whether the kernels are there.
`kernels=portable`, other devices, and machines without AVX2 or a C++ compiler keep `F.linear`.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from inferlab.errors import InvalidRequestError
from inferlab.paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("gemv.cpp", "decode_attention.cpp", "decode_step.cpp")]
KERNEL_CHOICES = ("fast", "portable")

log = logging.getLogger(__name__)


@functools.cache
def cpu_gemv_available() -> bool:
    """Build (first call on a machine: ~30 s; then cached) and load the AVX2 kernels; False where they cannot."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    build_dir = kernels_build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        print("inferlab: building the CPU decode kernels (once per machine) ...", file=sys.stderr, flush=True)
    try:
        # -fopenmp for at::parallel_for's pragmas: the process's libgomp is torch's, so the threads are torch's
        load(name="inferlab_kernels", sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
             is_python_module=False)
    except Exception as error:  # no compiler, no ninja: the portable path serves
        log.warning("CPU decode kernels unavailable (%s); using F.linear", str(error).splitlines()[0])
        return False
    return True


def kernels_build_dir() -> Path:
    """Where the build is cached: per torch version and per content of csrc/, so checkouts and versions that
    share the user cache dir never load each other's build."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return cache_dir() / "kernels" / f"torch-{torch.__version__}-{digest.hexdigest()[:12]}"


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip-installed one sits in the environment's scripts dir,
    which is not on PATH when a console script runs without the environment activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join(filter(None, (ninja.BIN_DIR, os.environ.get("PATH"))))


def fast_kernels_apply(device: torch.device, dtype: torch.dtype, kernels: str) -> bool:
    """`device.kernels=fast` on a CPU with float activations and the kernels built: the fast paths run."""
    if kernels not in KERNEL_CHOICES:
        raise InvalidRequestError(f"device.kernels={kernels!r}; use one of {list(KERNEL_CHOICES)}")
    return (kernels == "fast" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and cpu_gemv_available())
