"""An HF checkpoint's *.safetensors files, read one tensor at a time, each converted to the target dtype at once.

Only the JSON headers are read up front. A tensor's bytes come in with one read straight into the
parameter that will hold them (a row range of a fused projection, too) when the dtypes agree, else
into one buffer of the file's bytes that is converted into it: a bf16 checkpoint loaded in bf16 is
allocated exactly once, and one in fp32 only ever adds one tensor in flight. Memory-mapping the files instead would keep every page
read resident, counted in the process's RSS beside the converted copies, until the file is closed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from inferlab.errors import ModelLoadError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int


class SafetensorsFiles:
    """name -> tensor over every *.safetensors file of a directory."""

    def __init__(self, files: list[Path]) -> None:
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            self.entries.update(_read_header(path))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def get(self, name: str, dtype: torch.dtype) -> Tensor:
        entry = self._entry(name)
        out = torch.empty(entry.shape, dtype=dtype)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: Tensor) -> None:
        """Fill `out` (contiguous, the tensor's shape or its number of elements) with the tensor, converted to
        out's dtype: in place when the dtypes agree, else through one buffer of the file's bytes."""
        entry = self._entry(name)
        same = out.dtype == entry.dtype
        raw = out.view(torch.uint8).reshape(-1) if same else torch.empty(entry.nbytes, dtype=torch.uint8)
        with open(entry.path, "rb") as f:
            f.seek(entry.start)
            if f.readinto(raw.numpy()) != entry.nbytes:
                raise ModelLoadError(f"{entry.path.name}: truncated at tensor {name!r}")
        if not same:
            out.copy_(raw.view(entry.dtype).reshape(out.shape))

    def _entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}")
        return entry


def _read_header(path: Path) -> dict[str, TensorEntry]:
    with open(path, "rb") as f:
        try:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        except (struct.error, ValueError) as e:
            raise ModelLoadError(f"{path.name}: not a safetensors file ({e})") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ModelLoadError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries[name] = TensorEntry(path, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + begin, end - begin)
    return entries
