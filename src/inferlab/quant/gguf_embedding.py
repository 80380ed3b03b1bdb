"""A token embedding kept as the GGUF file's blocks, its rows dequantized as a step looks them up.

An untied model's embedding is as large as its LM head (Llama-3.1-8B: 128,256 x 4,096), and a step reads only its
tokens' rows, so nothing is gained by holding it dequantized: in bf16 it took 1,002 MiB where its Q4_1 blocks take
328. The rows come out with model/gguf_blocks.py's dequantizers, gguf's own values, in the model's dtype: the same
numbers the loader gave a float embedding. (A tied embedding looks its rows up in the int8 head instead:
quant/int8.py's Int8Embedding.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from inferlab.model.gguf_blocks import ROW_LAYOUTS, dequantize_blocks
from inferlab.model.gguf_loader import EMBEDDING_TENSOR, evict, open_gguf


class GGUFEmbedding(nn.Module):
    """Drop-in for nn.Embedding over GGUF blocks: uint8 (vocab, blocks per row, bytes per block) of format `kind`."""

    def __init__(self, kind: str, blocks: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.dtype = kind, dtype
        self.register_buffer("blocks", blocks)

    def forward(self, tokens: Tensor) -> Tensor:
        # tokens (...) -> (..., dim) in the model's dtype
        rows = dequantize_blocks(self.blocks[tokens.reshape(-1)], self.kind)
        return rows.to(self.dtype).view(*tokens.shape, -1)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.blocks.shape[0]}, format={self.kind}"


def read_gguf_embedding(path: Path, dtype: torch.dtype, device: torch.device) -> GGUFEmbedding:
    """The file's token embedding as its blocks (copied out of the file, whose pages then go)."""
    reader = open_gguf(path)
    tensor = next(t for t in reader.tensors if t.name == EMBEDDING_TENSOR)
    size = ROW_LAYOUTS[tensor.tensor_type.name][1]
    rows = np.array(tensor.data, dtype=np.uint8)  # (vocab, bytes per row)
    evict(reader, tensor)
    # shaped as blocks before torch sees them: a torch view would keep its base (kernels/huge_pages.py)
    return GGUFEmbedding(
        tensor.tensor_type.name, torch.from_numpy(rows.reshape(rows.shape[0], -1, size)).to(device), dtype
    )
