"""A GGUF file's decoder Linears requantized into a K-quant mix (quant/kquants.py), everything else copied as it is:
K-quant files of any model without llama.cpp's tools (tests, and the studies where llama.cpp is absent).

`python -m inferlab.quant.requantize_gguf SRC.gguf DST.gguf [Q4_K_M|Q5_K_M|Q6_K]`

The mix follows llama.cpp's rule for its *_K_M types: attn_v and ffn_down in Q6_K in the first and last eighth of the
layers and every third between, the other Linears in the base K-quant; a tensor whose rows are not a multiple of 256
weights falls back to the 32-weight format of about as many bits (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), as
llama.cpp does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import torch

from inferlab.errors import QuantizationError
from inferlab.model.gguf_loader import dequantize, open_gguf
from inferlab.quant.kquants import quantize_blocks

MIXES = {"Q4_K_M": ("Q4_K", 15), "Q5_K_M": ("Q5_K", 17), "Q6_K": ("Q6_K", 18)}  # base format, general.file_type
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
LINEAR = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_qkv|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")


def more_bits(layer: int, n_layers: int) -> bool:
    """The layers whose attn_v and ffn_down a *_K_M file keeps in Q6_K."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def mix_format(name: str, columns: int, n_layers: int, mix: str) -> str | None:
    """The block format `mix` gives tensor `name` (None: not a decoder Linear, copied as it is)."""
    found = LINEAR.fullmatch(name)
    if found is None:
        return None
    base = MIXES[mix][0]
    kind = "Q6_K" if found[2] in ("attn_v", "ffn_down") and more_bits(int(found[1]), n_layers) else base
    return kind if columns % 256 == 0 else FALLBACK[kind]


def requantize_gguf(src: Path, dst: Path, mix: str = "Q4_K_M", embedding: str | None = None) -> Path:
    """Write `src` with its decoder Linears in `mix` to `dst`, and its token embedding in block format `embedding`
    (None: as it is; llama-quantize's --token-embedding-type); returns `dst`."""
    import gguf

    if mix not in MIXES:
        raise QuantizationError(f"no K-quant mix {mix!r}; use one of {list(MIXES)}")
    fields = gguf.GGUFReader(str(src)).fields  # with their value types, which the writer needs
    parsed = open_gguf(src)
    arch = parsed.fields["general.architecture"]
    n_layers = int(parsed.fields[f"{arch}.block_count"])
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_file_type(MIXES[mix][1])
    for tensor in parsed.tensors:
        columns = int(tensor.shape[0])
        kind = embedding if tensor.name == "token_embd.weight" else mix_format(tensor.name, columns, n_layers, mix)
        if kind is None:
            raw = None if tensor.tensor_type.name in ("F32", "F16") else tensor.tensor_type
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=raw)
            continue
        blocks = quantize_blocks(dequantize(tensor, torch.float32), kind)
        writer.add_tensor(
            tensor.name, blocks.reshape(blocks.shape[0], -1).numpy(), raw_dtype=gguf.GGMLQuantizationType[kind]
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(f"usage: python -m inferlab.quant.requantize_gguf SRC.gguf DST.gguf [{'|'.join(MIXES)}]")
    print(requantize_gguf(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]))
