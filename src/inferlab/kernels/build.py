"""Build and load the C++ kernels (csrc/) once per machine and instruction set, pick the set a process
runs (`device.isa`), and say where they apply (`device.kernels`).

Decoding multiplies a handful of activation rows by every weight matrix, so its speed is how fast
the weights stream from memory. On CPU the library paths (F.linear, oneDNN's prepacked weights) fall well short
of that for these matrix-vector products, so inferlab builds its own kernels on first
use and caches the build: csrc/gemv.h (fp32, bf16, int8 and int4 weights, one pass over each row;
gemv.py), csrc/attention.h (one query per sequence through block tables; attention.py) and
csrc/decode_step.cpp (the whole decode step; fused_decode.py). Each instruction set of isa.py is its
own build (cache/kernels/torch-<version>-<digest>/<isa>/, compiled from the copy of csrc/ beside it) with
its own op library (torch.ops.inferlab_<isa>); the process calls one of them, chosen once at load
(`use_isa`) and logged. Nothing here runs at import: the build happens on the first call that asks
whether the kernels are there.
`kernels=portable`, other devices, and machines without AVX2 or a C++ compiler keep `F.linear`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from inferlab.errors import InvalidRequestError
from inferlab.kernels.isa import ISAS, Isa, resolve_isa, supported_isas
from inferlab.paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
GEMV_SOURCE = CSRC / "gemv.cpp"  # the gemv op alone
SOURCES = [GEMV_SOURCE, CSRC / "decode_attention.cpp", CSRC / "decode_step.cpp"]
KERNEL_CHOICES = ("fast", "portable")
# -fopenmp for at::parallel_for's pragmas: the process's libgomp is torch's, so the threads are torch's.
# -ffp-contract=off: a scalar a * b + c stays two roundings wherever it is inlined (GCC fuses it into an fma
# in some instantiations and not others), so a row's product does not depend on the shape of its call
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
STALE_LOCK_S = 600  # far longer than a build takes: a build lock older than this was left by a killed build

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """The build this process calls."""

    made: bool = False
    isa: Isa | None = None  # None: no kernels (portable path)


_choice = Choice()


@functools.cache
def load_isa(name: str) -> bool:
    """Build (first call on a machine: ~1 min; then cached) and load the kernels for one instruction set;
    False where they cannot be built (no compiler, no ninja)."""
    isa = ISAS[name]
    build_dir = kernels_build_dir(isa)
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    if not any(build_dir.glob("*.so")):
        print(
            f"inferlab: building the CPU decode kernels for {isa.about} (once per machine) ...",
            file=sys.stderr,
            flush=True,
        )
    try:
        sources = copied_sources(build_dir.parent)
        compile_kernels(isa, isa.name, [sources / p.name for p in SOURCES], build_dir)
    except Exception as error:  # no compiler, no ninja: the portable path serves
        log.warning("CPU decode kernels unavailable (%s); using F.linear", str(error).splitlines()[0])
        return False
    return True


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> None:
    """torch's builder holds a file `lock` in the build directory while it compiles, and every other process that
    loads the same build waits for it to go away. A build killed midway leaves it behind, and every later load then
    waits forever, saying nothing (seen: a test run hung 15 minutes after an earlier one was killed while building).
    A lock older than any build is removed, saying so; a recent one is said to be waited on."""
    lock = build_dir / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age_s > max_age_s:
        log.warning("removing %s, left %.0f min ago by a kernel build that did not finish", lock, age_s / 60)
        lock.unlink(missing_ok=True)
    else:
        print(
            f"inferlab: waiting for another process's kernel build to release {lock} ...", file=sys.stderr, flush=True
        )


def compile_kernels(isa: Isa, name: str, sources: list[Path], build_dir: Path) -> None:
    """Compile `sources` for `isa` into build_dir (unless built there already) and load them: the op library the
    sources name (simd.h's INFERLAB_OPS; `name` only names the shared object)."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    load(
        name=f"inferlab_kernels_{name}",
        sources=[str(p) for p in sources],
        build_directory=str(build_dir),
        extra_cflags=[*CFLAGS, *isa.cflags],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )


def kernels_build_dir(isa: Isa) -> Path:
    """Where a build is cached: per instruction set, torch version, compiler flags, the content of csrc/ and the
    path of torch's headers (the same venv reached through a link is another path). Builds compile a copy of the
    sources kept beside them (copied_sources), so the ninja file torch writes names that copy, not a checkout:
    checkouts and installed wheels that hold the same sources share one build, and none finds another's build
    stale and rebuilds it."""
    digest = hashlib.sha256("\0".join((*CFLAGS, str(Path(torch.__file__).parent))).encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    # resolved: through a linked cache dir the copy's path, which torch's ninja file names, stays the same
    return (cache_dir() / "kernels").resolve() / f"torch-{torch.__version__}-{digest.hexdigest()[:12]}" / isa.name


def copied_sources(root: Path) -> Path:
    """csrc/ copied to root/csrc (once: written under a name of this process's, then renamed into place, so a
    process never compiles a copy another is still writing); its content is what names root."""
    copy = root / "csrc"
    if not copy.is_dir():
        partial = root / f"csrc.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(CSRC, partial)
        try:
            partial.rename(copy)
        except OSError:  # another process's copy is in place (same content)
            shutil.rmtree(partial, ignore_errors=True)
    return copy


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip-installed one sits in the environment's scripts dir,
    which is not on PATH when a console script runs without the environment activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join(filter(None, (ninja.BIN_DIR, os.environ.get("PATH"))))


def use_isa(requested: str = "auto") -> str | None:
    """Choose (and build) the kernels this process calls: `device.isa` = auto (the widest this CPU runs),
    avx2 or avx512. Returns the chosen instruction set, or None where no kernels can run (the portable
    path serves). A named set the CPU lacks raises InvalidRequestError."""
    named = resolve_isa(requested)  # checks the name, and that this CPU runs it
    # auto falls back to a narrower build where a wider one does not build (a compiler without AVX-512 BF16)
    candidates = [ISAS[name] for name in reversed(supported_isas())] if requested == "auto" else [named]
    isa = next((c for c in candidates if load_isa(c.name)), None)
    log.info("CPU decode kernels: %s (device.isa=%s)", isa.about if isa else "none, F.linear serves", requested)
    _choice.made, _choice.isa = True, isa
    return isa.name if isa else None


def active_isa() -> Isa | None:
    """The build this process calls (chosen at first use, when no engine chose one: device.isa=auto)."""
    if not _choice.made:
        use_isa("auto")
    return _choice.isa


def cpu_gemv_available() -> bool:
    """The kernels are built and loaded for this CPU."""
    return active_isa() is not None


def kernel_ops():
    """The chosen build's ops: kernel_ops().gemv, .decode_attention."""
    return getattr(torch.ops, active_isa().ops)


@functools.cache
def _int4_tile_rows(ops: str) -> int:
    return getattr(torch.ops, ops).int4_tile_rows()


def int4_tile_rows() -> int:
    """Weight rows per block of int4 tiles in the chosen build (its vectors' lanes: 16 on AVX-512, 8 on AVX2)."""
    return _int4_tile_rows(active_isa().ops)


@functools.cache
def _bf16_block_rows(ops: str) -> int:
    return getattr(torch.ops, ops).bf16_block_rows()


def bf16_block_rows() -> int:
    """Weight rows per block of bf16 weights laid out for the chosen build (csrc/gemv.h: Bf16Blocks; 16 on the avx512
    build), 0 where it reads them as rows (avx2; amx, whose tiles take rows)."""
    return _bf16_block_rows(active_isa().ops)


def kernel_classes():
    """The chosen build's classes: kernel_classes().DecodePlan."""
    return getattr(torch.classes, active_isa().ops)


def fast_kernels_apply(device: torch.device, dtype: torch.dtype, kernels: str) -> bool:
    """`device.kernels=fast` on a CPU with float activations and the kernels built: the fast paths run."""
    if kernels not in KERNEL_CHOICES:
        raise InvalidRequestError(f"device.kernels={kernels!r}; use one of {list(KERNEL_CHOICES)}")
    return (
        kernels == "fast" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_gemv_available()
    )


def build_every_isa() -> list[str]:
    """Build (or find cached) every kernel build this CPU runs, as the first process to call each would; the builds
    that failed are left out of what it returns."""
    return [name for name in supported_isas() if load_isa(name)]


if __name__ == "__main__":  # `make kernels`
    supported, built = supported_isas(), build_every_isa()
    print(f"CPU decode kernels built: {', '.join(built) or 'none'} (this CPU runs: {', '.join(supported) or 'none'})")
    sys.exit(0 if built == supported else 1)
