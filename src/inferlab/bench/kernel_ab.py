"""Two builds of the CPU kernels timed side by side in one process: this checkout's csrc/ and another copy of it
(a change under test), on the same products of SmolLM2's layer shapes, in turns, round after round.

    python -m inferlab.bench.kernel_ab OTHER_CSRC [--formats fp32,bf16,int8,int4,int4_x8] [--rows 1,5,128] [--layers 1]
        [--model 135m|360m|1.7b]

On a shared machine the speed of one process drifts by tens of percent within minutes, so two processes run one
after the other (one per build) disagree by more than most kernel changes are worth; in turns within one process
both builds meet the same drift, and the median of their per-round ratio is what changed. The other build is
compiled under an instruction set name of its own (simd.h's INFERLAB_ISA with a suffix: its symbols and op
library apart from this checkout's), and cached by its content. Each product's results are compared too: a
change that keeps every row's sums in their order keeps them to the bit.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from inferlab.kernels.build import CSRC, GEMV_SOURCE, active_isa, compile_kernels, kernel_ops, kernels_build_dir
from inferlab.kernels.gemv import pack_bf16
from inferlab.kernels.isa import Isa
from inferlab.quant.gguf_tiles import q4_k_tiles, q5_0_tiles, q6_k_tiles, q8_0_tiles
from inferlab.quant.int4 import pack_nibbles, quantize_groups_int4, tile_parts, tile_rows
from inferlab.quant.kquants import quantize_blocks

# SmolLM2's qkv, o, gate|up, down (N, K)
MODEL_SHAPES = {
    "135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "360m": [(1600, 960), (960, 960), (5120, 960), (960, 2560)],
    "1.7b": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}
# int4_x8: int4 weights, int8 activation codes (a draft's); int4_bf16: int4 weights multiplied in bf16 on the amx build
# (the fused step's from its dense_from_rows: csrc/amx.h's Int4DequantTiles)
# q4_k, q6_k: GGUF blocks as a K-quant file keeps them (csrc/ggml_blocks.h), the 32-weight format of about as many bits
# where K is not a multiple of 256 (Q5_0, Q8_0), as in SmolLM2-135M's Q4_K_M; q4_k_tiles, q6_k_tiles: the same blocks
# as the int4 kernel's tiles, which is how a K-quant file is served (quant/gguf_tiles.py)
FORMATS = ("fp32", "bf16", "int8", "int4", "int4_x8", "int4_bf16", "q4_k", "q6_k", "q4_k_tiles", "q6_k_tiles")
GGUF_FORMATS = {"q4_k": ("Q4_K", "Q5_0"), "q6_k": ("Q6_K", "Q8_0")}
GGUF_TILES = {"Q4_K": q4_k_tiles, "Q6_K": q6_k_tiles, "Q5_0": q5_0_tiles, "Q8_0": q8_0_tiles}
Weights = tuple[Tensor, Tensor | None, Tensor | None]  # weight, scales, mins as the gemv op takes them


@dataclass
class Comparison:
    format: str
    rows: int
    gflops: tuple[float, float]  # this checkout's build, the other's: medians over the rounds
    ratio: float  # the median over rounds of this build's time over the other's (> 1: the other is faster)
    same: bool  # every product equal to the bit


def load_build(csrc: Path, isa: Isa) -> Any:
    """The gemv op of `csrc` for `isa`, under a name of its own: its op library (torch.ops.inferlab_<name>). Only
    gemv.cpp is compiled (what is timed; the whole build takes three times as long)."""
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(csrc.iterdir())))
    name = f"{isa.name}_ab{digest.hexdigest()[:10]}"
    root = kernels_build_dir(isa).parent.parent / "ab" / name
    sources = root / "csrc"
    if not sources.exists():
        shutil.copytree(csrc, sources)
        simd = sources / "simd.h"
        simd.write_text(
            simd.read_text().replace(f"#define INFERLAB_ISA {isa.name}\n", f"#define INFERLAB_ISA {name}\n")
        )
    compile_kernels(isa, name, [sources / GEMV_SOURCE.name], root)
    return getattr(torch.ops, f"inferlab_{name}")


def random_weights(weight_format: str, n: int, k: int, tile_rows_: int) -> Weights:
    """An (n, k) layer in `weight_format`, random values, laid out as the kernels read it (bf16: as rows;
    bf16_layout lays them out for each build)."""
    if weight_format.startswith("int4"):
        codes, scales, mins = quantize_groups_int4(torch.randn(n, k), 32)
        tiles = tile_rows(pack_nibbles(codes), scales, mins, tile_rows_)
        _, tile_scales, tile_mins = tile_parts(tiles, scales.shape[1])
        return tiles, tile_scales, tile_mins
    if (blocks_format := weight_format.removesuffix("_tiles")) in GGUF_FORMATS:
        kquant, fallback = GGUF_FORMATS[blocks_format]
        kind = kquant if k % 256 == 0 else fallback
        blocks = quantize_blocks(torch.randn(n, k), kind)
        return (GGUF_TILES[kind](blocks, tile_rows_) if weight_format.endswith("_tiles") else blocks), None, None
    if weight_format == "int8":
        return torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100, None
    return torch.randn(n, k).to(torch.float32 if weight_format == "fp32" else torch.bfloat16), None, None


def bf16_layout(ops: Any, weights: Weights) -> Weights:
    """bf16 rows in the blocks a build reads (kernels/gemv.py: pack_bf16), where it does: each build gets the layout
    it serves (a build from before the blocks has no bf16_block_rows op)."""
    weight, scales, mins = weights
    rows = ops.bf16_block_rows() if weight.dtype == torch.bfloat16 and hasattr(ops, "bf16_block_rows") else 0
    return (pack_bf16(weight, rows), scales, mins) if rows and weight.shape[0] % rows == 0 else weights


def compare(
    other: Path,
    formats: list[str],
    rows: list[int],
    layers: int = 1,
    rounds: int = 20,
    min_flops: float = 2e8,
    model: str = "135m",
) -> list[Comparison]:
    """Time every product of `layers` layers of `model`'s shapes (distinct weights: more layers, more of them streamed
    from memory) at each count of activation rows, this checkout's build and `other`'s in turns, `rounds` times."""
    isa = active_isa()
    if isa is None:
        raise RuntimeError("the CPU kernels are not built here (no AVX2 or no C++ compiler)")
    builds = [kernel_ops(), load_build(other, isa)]
    tile_rows_ = builds[0].int4_tile_rows()
    shapes = MODEL_SHAPES[model] * layers
    results = []
    for weight_format in formats:
        weights = [random_weights(weight_format, n, k, tile_rows_) for n, k in shapes]
        laid_out = [[bf16_layout(ops, w) for w in weights] for ops in builds]
        x8 = weight_format == "int4_x8"  # int8 activation codes
        bf16_from_rows = 1 if weight_format == "int4_bf16" else 0
        for m in rows:
            xs = [torch.randn(m, k) for _, k in shapes]
            flops = 2 * m * sum(n * k for n, k in shapes)
            repeats = max(1, int(min_flops // flops))

            def run(ops: Any, build_weights: list[Weights]) -> list[Tensor]:
                return [
                    ops.gemv(x, w, s, None, None, 0.0, mins, False, x8, bf16_from_rows)
                    for x, (w, s, mins) in zip(xs, build_weights)
                ]

            same = all(torch.equal(a, b) for a, b in zip(*(run(*build) for build in zip(builds, laid_out))))
            seconds: list[list[float]] = [[], []]
            for _ in range(rounds):
                for ops, build_weights, timed in zip(builds, laid_out, seconds):
                    start = time.perf_counter()
                    for _ in range(repeats):
                        run(ops, build_weights)
                    timed.append((time.perf_counter() - start) / repeats)
            ratio = statistics.median(a / b for a, b in zip(*seconds))
            gflops = tuple(flops / statistics.median(timed) / 1e9 for timed in seconds)
            results.append(Comparison(weight_format, m, (gflops[0], gflops[1]), ratio, same))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="a copy of kernels/csrc with the change under test")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--rows", default="1,5,128", help="activation rows per product")
    parser.add_argument("--layers", type=int, default=1, help="30: a whole model's weights, beyond the caches")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model", default="135m", choices=sorted(MODEL_SHAPES), help="SmolLM2's layer shapes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as they are)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"this checkout: {CSRC}\nother: {args.other}\n")
    print(f"{'format':10} {'rows':>5} {'GF/s here':>10} {'GF/s other':>10} {'other faster':>12}  same")
    formats = [f for f in args.formats.split(",") if f]
    if unknown := sorted(set(formats) - set(FORMATS)):
        parser.error(f"--formats: {unknown} not among {list(FORMATS)}")
    rows = [int(r) for r in args.rows.split(",")]
    for c in compare(args.other, formats, rows, args.layers, args.rounds, model=args.model):
        print(f"{c.format:10} {c.rows:5d} {c.gflops[0]:10.0f} {c.gflops[1]:10.0f} {c.ratio:11.2f}x  {c.same}")


if __name__ == "__main__":
    main()
