"""task=draft: a shallow draft for a real target, distilled on the target's own distributions.

The draft keeps the target's embedding and head (frozen, so the vocabulary is shared by construction)
and a few of its layers as the starting point; only those layers and the final norm train. Training
data is corpus text; the labels are the target's next-token distributions, so the draft learns to
agree with the target, which is what the acceptance rate pays for.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from inferlab.model.loader import load_model
from inferlab.model.transformer import Transformer
from inferlab.paths import default_draft_dir
from inferlab.train.checkpoint import count_parameters, save_checkpoint
from inferlab.train.corpus import load_tokens
from inferlab.train.data import random_windows
from inferlab.train.loop import LoopConfig, train
from inferlab.train.losses import agreement, distill_loss


def draft_from_target(target: Transformer, layers: list[int]) -> Transformer:
    """The target's embedding/head/final norm plus copies of `layers`; embedding and head frozen."""
    if not layers or any(not 0 <= i < target.config.n_layers for i in layers):
        raise ValueError(f"draft layers {layers} must be indices into the target's {target.config.n_layers} layers")
    config = dataclasses.replace(target.config, n_layers=len(layers))
    device = target.tok_embeddings.weight.device
    with torch.device(device):
        draft = Transformer(config)
    source = target.state_dict()
    state = {k: v for k, v in source.items() if not k.startswith("layers.")}
    for new, old in enumerate(layers):
        prefix = f"layers.{old}."
        state.update({f"layers.{new}.{k[len(prefix) :]}": v for k, v in source.items() if k.startswith(prefix)})
    draft.load_state_dict({k: v.detach().clone().float() for k, v in state.items()})
    draft.tok_embeddings.weight.requires_grad_(False)
    draft.output.weight.requires_grad_(False)
    return draft.float()


def train_draft(cfg: DictConfig, device: torch.device) -> Path:
    d = cfg.draft
    loaded = load_model(OmegaConf.to_container(cfg.model, resolve=True), torch.float32, device, cfg.cache.max_seq_len)
    target = loaded.model.requires_grad_(False)
    draft = draft_from_target(target, list(d.layers))
    train_tokens = load_tokens(loaded.tokenizer, cfg.corpus, "train").to(device)
    val_batch = random_windows(
        load_tokens(loaded.tokenizer, cfg.corpus, "val").to(device),
        cfg.eval_batch_size,
        d.seq_len,
        torch.Generator(device="cpu").manual_seed(cfg.seed + 1),
    )
    before = agreement(draft, target, val_batch)
    print(
        f"draft: layers {list(d.layers)} of {loaded.source}, {count_parameters(draft, True) / 1e6:.1f}M trainable; "
        f"{train_tokens.numel()} train tokens; held-out before: {before}"
    )
    batches = torch.Generator(device="cpu").manual_seed(cfg.seed)

    def next_loss(step: int) -> torch.Tensor:
        return distill_loss(
            draft, target, random_windows(train_tokens, d.batch_size, d.seq_len, batches), d.temperature
        )

    losses = train(draft, next_loss, LoopConfig(**d.loop, progress=cfg.progress), desc="distill draft")
    after = agreement(draft, target, val_batch)
    print(f"held-out after: {after}")
    out = Path(cfg.out).expanduser() if cfg.out else default_draft_dir(cfg.model.name)
    report = {
        "task": "draft",
        "target": loaded.source,
        "layers": list(d.layers),
        "seed": cfg.seed,
        "steps": d.loop.steps,
        "final_loss": losses[-1] if losses else None,
        "before": before,
        "after": after,
    }
    save_checkpoint(draft, loaded.tokenizer, out, {"inferlab": json.dumps(report)})
    (out / "train.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return out
