"""task=scratch: the seed's learning path, a small target and a smaller draft trained from nothing.

A byte-level BPE tokenizer is trained on the corpus's training documents; the target learns the
corpus by next-token cross-entropy, then the draft is distilled from the trained target, so the pair
shows the speedup of a classic target/draft setup with weights anyone can rebuild offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from inferlab.model.config import ModelConfig
from inferlab.model.tokenizer import Tokenizer
from inferlab.model.transformer import Transformer
from inferlab.paths import cache_dir, default_draft_dir
from inferlab.train.checkpoint import count_parameters, save_checkpoint
from inferlab.train.corpus import load_tokens, split_documents
from inferlab.train.data import random_windows
from inferlab.train.loop import LoopConfig, train
from inferlab.train.losses import agreement, distill_loss, lm_loss

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (any text encodes, nothing is unknown) with one end-of-text token."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(EOS, special=True)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    eos = backend.token_to_id(EOS)
    return Tokenizer(backend=backend, bos_id=None, eos_ids={eos}, special_ids={eos})


def init_model(arch: dict, vocab_size: int, max_seq_len: int, device: torch.device) -> Transformer:
    """GPT-2-style init: N(0, 0.02), output projections scaled down by depth; tied embeddings."""
    config = ModelConfig(vocab_size=vocab_size, max_seq_len=max_seq_len, tie_embeddings=True, **arch)
    with torch.device(device):
        model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 0.02 / (2 * config.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
            p.normal_(0.0, std)
    return model


def train_scratch(cfg: DictConfig, device: torch.device) -> Path:
    s = cfg.scratch
    tokenizer = train_tokenizer([text for _, text in split_documents(cfg.corpus, "train")], s.vocab_size)
    train_tokens = load_tokens(tokenizer, cfg.corpus, "train").to(device)
    val_batch = random_windows(
        load_tokens(tokenizer, cfg.corpus, "val").to(device),
        cfg.eval_batch_size,
        s.seq_len,
        torch.Generator(device="cpu").manual_seed(cfg.seed + 1),
    )
    vocab = tokenizer.vocab_size
    target = init_model(OmegaConf.to_container(s.target), vocab, s.max_seq_len, device)
    draft = init_model(OmegaConf.to_container(s.draft), vocab, s.max_seq_len, device)
    print(
        f"scratch: tokenizer {vocab} tokens, {train_tokens.numel()} train tokens; target "
        f"{count_parameters(target) / 1e6:.2f}M, draft {count_parameters(draft) / 1e6:.2f}M parameters"
    )
    batches = torch.Generator(device="cpu").manual_seed(cfg.seed)

    def target_loss(step: int) -> torch.Tensor:
        return lm_loss(target, random_windows(train_tokens, s.batch_size, s.seq_len, batches))

    target_losses = train(
        target, target_loss, LoopConfig(**s.target_loop, progress=cfg.progress), desc="scratch target"
    )
    target.requires_grad_(False)
    with torch.no_grad():
        val_loss = float(lm_loss(target, val_batch))

    def draft_loss(step: int) -> torch.Tensor:
        return distill_loss(draft, target, random_windows(train_tokens, s.batch_size, s.seq_len, batches))

    draft_losses = train(draft, draft_loss, LoopConfig(**s.draft_loop, progress=cfg.progress), desc="scratch draft")
    report = {
        "task": "scratch",
        "corpus": cfg.corpus,
        "seed": cfg.seed,
        "vocab_size": vocab,
        "target_final_loss": target_losses[-1] if target_losses else None,
        "target_val_loss": val_loss,
        "draft_final_kl": draft_losses[-1] if draft_losses else None,
        "draft": agreement(draft, target, val_batch),
    }
    print(f"held-out: target loss {val_loss:.3f}; draft vs target {report['draft']}")
    dirs = scratch_dirs(Path(cfg.out).expanduser() if cfg.out else None)
    for name, model in (("target", target), ("draft", draft)):
        save_checkpoint(model, tokenizer, dirs[name], {"inferlab": json.dumps(report)})
        (dirs[name] / "train.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {dirs['target']} and {dirs['draft']}")
    return dirs["target"]


def scratch_dirs(out: Path | None) -> dict[str, Path]:
    """`out`/target and `out`/draft; by default where model=scratch and spec=draft look for them."""
    if out is not None:
        return {"target": out / "target", "draft": out / "draft"}
    return {"target": cache_dir() / "models" / "scratch", "draft": default_draft_dir("scratch")}
