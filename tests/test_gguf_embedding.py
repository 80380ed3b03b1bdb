"""An untied model's token embedding stays the GGUF file's blocks when its Linears are quantized: its rows are gguf's
dequantized values in the model's dtype, the model's logits are those of the same model with the dequantized
embedding, and it holds the blocks' bytes, not a float matrix."""

from __future__ import annotations

import gguf
import pytest
import torch
from conftest import byte_level_backend
from gguf_writer import byte_level_vocab, write_gguf
from test_gguf_blocks import tiny_llama

from inferlab.api import load_engine
from inferlab.model.gguf_blocks import ROW_LAYOUTS
from inferlab.quant.gguf_embedding import GGUFEmbedding
from inferlab.quant.requantize_gguf import requantize_gguf


@pytest.fixture(scope="module")
def fp32_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("untied")
    return write_gguf(tiny_llama(256, tied=False), folder / "f32.gguf", byte_level_vocab(byte_level_backend()))


@pytest.mark.parametrize(
    ("kind", "precision"), [("Q4_1", "int4"), ("Q8_0", "int8"), ("Q4_K", "auto"), ("Q6_K", "gguf")]
)
def test_an_untied_embedding_keeps_the_files_blocks(fp32_file, tmp_path, kind, precision):
    path = requantize_gguf(fp32_file, tmp_path / f"{kind}.gguf", "Q4_K_M", embedding=kind)
    engine = load_engine(
        model="local", precision=precision, device="cpu", **{"model.path": str(path), "cache.max_seq_len": 64}
    )
    model = engine.model
    embedding = model.tok_embeddings
    assert isinstance(embedding, GGUFEmbedding) and embedding.kind == kind
    vocab, dim = model.config.vocab_size, model.config.dim
    assert embedding.blocks.nbytes == vocab * dim // ROW_LAYOUTS[kind][0] * ROW_LAYOUTS[kind][1]
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    dequantized = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).to(embedding.dtype)
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    assert torch.equal(embedding(tokens), dequantized[tokens])  # gguf's values, to the bit
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        got = model(tokens, positions)
        model.tok_embeddings = torch.nn.Embedding(vocab, dim, _weight=dequantized)
        want = model(tokens, positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    engine.close()


def test_a_float_model_keeps_a_float_embedding(fp32_file, tmp_path):
    path = requantize_gguf(fp32_file, tmp_path / "q8.gguf", "Q4_K_M", embedding="Q8_0")
    engine = load_engine(
        model="local", precision="fp32", device="cpu", **{"model.path": str(path), "cache.max_seq_len": 64}
    )
    assert isinstance(engine.model.tok_embeddings, torch.nn.Embedding)
    engine.close()
