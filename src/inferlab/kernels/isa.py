"""The instruction sets the C++ kernels are built for, and which of them this CPU runs (`device.isa`).

Every kernel is one source (csrc/simd.h's SIMD layer) compiled once per instruction set: AVX2 + FMA;
AVX-512 F/BW/VL with VNNI (integer dots) and BF16 (bf16 dots), 512-bit registers; and that with AMX's
bf16 tiles, which multiply bf16 weights (csrc/amx.h) where Linux lets the process use them. Which one a
process uses is chosen once, at load, from what the CPU reports: Linux's /proc/cpuinfo flags (the kernel
lists only what it has enabled), else torch's own probe, which names AVX2 and AVX-512 but not VNNI or BF16
(so there the AVX2 build serves).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from inferlab.errors import InvalidRequestError

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class Isa:
    name: str
    cpu_flags: tuple[str, ...]  # as /proc/cpuinfo spells them
    cflags: tuple[str, ...]  # the compiler flags (and the macro simd.h reads) of its build
    about: str
    tiles: bool = False  # runs AMX tiles, which Linux grants a process on request (amx_bf16_usable)

    @property
    def ops(self) -> str:
        """Its op library: torch.ops.<ops> and torch.classes.<ops> (simd.h's INFERLAB_OPS)."""
        return f"inferlab_{self.name}"


AVX512_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")
AVX512_CFLAGS = (
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-mavx512bf16",
    "-DINFERLAB_AVX512",
)
ISAS = {  # from the narrowest up: "auto" takes the last one the CPU has
    "avx2": Isa("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), "AVX2 + FMA"),
    "avx512": Isa("avx512", AVX512_FLAGS, AVX512_CFLAGS, "AVX-512 F/BW/VL + VNNI + BF16"),
    "amx": Isa(
        "amx",
        (*AVX512_FLAGS, "amx_tile", "amx_bf16", "amx_int8"),
        (*AVX512_CFLAGS, "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-DINFERLAB_AMX"),
        "AVX-512 F/BW/VL + VNNI + BF16, AMX bf16 and int8 tiles",
        tiles=True,
    ),
}
ISA_CHOICES = ("auto", *ISAS)
TORCH_CAPABILITY_FLAGS = {  # every CPU torch reports AVX2 on has F16C too
    "AVX2": {"avx2", "fma", "f16c"},
    "AVX512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"},
}


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, in /proc/cpuinfo's spelling."""
    if CPUINFO.is_file():
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    return frozenset(TORCH_CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ()))


def supported_isas() -> list[str]:
    """The instruction sets this CPU runs, narrowest first."""
    flags = cpu_flags()
    return [
        name for name, isa in ISAS.items() if flags.issuperset(isa.cpu_flags) and (not isa.tiles or amx_bf16_usable())
    ]


ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86_64


@cache
def amx_bf16_usable() -> bool:
    """The CPU has AMX's bf16 tiles and Linux lets this process use them (arch_prctl ARCH_REQ_XCOMP_PERM, asked
    once for all its threads: a CPU may list amx_tile while its kernel or hypervisor keeps the tiles off). Then
    oneDNN's bf16 GEMM runs on them, as torch's F.linear does for bf16 tensors."""
    import ctypes
    import platform

    if not {"amx_tile", "amx_bf16"} <= cpu_flags() or platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    return ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def resolve_isa(requested: str) -> Isa | None:
    """`device.isa` -> the build to load: auto = the widest this CPU runs (None: not even AVX2, so no
    kernels); a named one the CPU lacks is an error, said in one line."""
    if requested not in ISA_CHOICES:
        raise InvalidRequestError(f"device.isa={requested!r}; use one of {list(ISA_CHOICES)}")
    supported = supported_isas()
    if requested == "auto":
        return ISAS[supported[-1]] if supported else None
    if requested not in supported:
        missing = sorted(set(ISAS[requested].cpu_flags) - cpu_flags())
        lack = f"this CPU lacks {', '.join(missing)}" if missing else "Linux does not let this process use AMX tiles"
        raise InvalidRequestError(
            f"device.isa={requested}: {lack} "
            f"(it runs: {', '.join(supported) or 'none of ' + str(list(ISAS))}); use device.isa=auto"
        )
    return ISAS[requested]
