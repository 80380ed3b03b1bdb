"""The resolved `spec` config group -> what the engine speculates with (None for spec=off): the drafter, loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inferlab.engine.spec.draft_model import ModelDrafter
from inferlab.engine.spec.proposers import Drafter, NgramDrafter
from inferlab.engine.spec.session import Speculation
from inferlab.errors import ModelLoadError
from inferlab.model.transformer import Transformer
from inferlab.paths import default_draft_dir
from inferlab.quant.self_draft import self_draft


def build_speculation(
    spec: dict[str, Any],
    model_name: str,
    target: Transformer,
    dtype: torch.dtype,
    device: torch.device,
    gguf_path: Path | None = None,
) -> Speculation | None:
    """The resolved `spec` config group -> Speculation (None for spec=none or off). `gguf_path`: the target's file,
    whose Q4_1 blocks a spec=self int4 draft imports as they are."""
    name = spec["name"]
    drafter: Drafter
    if name == "none":
        return None
    if name == "ngram":
        drafter = NgramDrafter(max_n=int(spec["ngram_max"]), min_n=int(spec["ngram_min"]))
    elif name == "draft":
        path = Path(str(spec["draft_model"])).expanduser() if spec.get("draft_model") else default_draft_dir(model_name)
        drafter = ModelDrafter(
            load_draft_model(path, target, dtype, device, build_hint=str(spec["build"])),
            min_confidence=float(spec["min_confidence"]),
        )
    elif name == "self":
        drafter = ModelDrafter(
            self_draft(target, str(spec["draft_precision"]), gguf_path, int(spec["draft_vocab"])),
            "self",
            float(spec["min_confidence"]),
            target_kv=True,
            int8_from_rows=int(spec["draft_int8_from_rows"]),
        )
    else:
        raise ModelLoadError(f"unknown spec {name!r}: use spec=none (or off), spec=ngram, spec=draft or spec=self")
    return Speculation(drafter, int(spec["k"]), bool(spec["adaptive"]))


def load_draft_model(
    path: Path, target: Transformer, dtype: torch.dtype, device: torch.device, build_hint: str = ""
) -> Transformer:
    """A draft checkpoint (HF directory, as inferlab-train writes them) that must share the target's vocabulary."""
    from inferlab.model.loader import load_model

    if not (path / "config.json").is_file():
        hint = f"; build it with {build_hint}" if build_hint else ""
        raise ModelLoadError(f"draft model not found at {path}{hint}")
    draft = load_model({"path": str(path)}, dtype, device, target.config.max_seq_len).model
    if draft.config.vocab_size != target.config.vocab_size:
        raise ModelLoadError(
            f"draft model {path} has vocabulary {draft.config.vocab_size}, "
            f"the target {target.config.vocab_size}: they must share one tokenizer"
        )
    return draft
