"""Training pieces against references: copied layers reproduce the target, checkpoints reload exactly
(our loader and transformers), distillation lowers the KL it optimizes, and a seed fixes the result."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from inferlab.model.loader import load_model
from inferlab.train.checkpoint import save_checkpoint
from inferlab.train.data import random_windows
from inferlab.train.draft import draft_from_target
from inferlab.train.loop import LoopConfig, train
from inferlab.train.losses import agreement, distill_loss, lm_loss, positions_for
from inferlab.train.scratch import EOS, init_model, train_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, positions_for(tokens))


TOKENS = torch.randint(0, 257, (2000,), generator=torch.Generator().manual_seed(0))
QUIET = dict(weight_decay=0.0, warmup=2, clip=1.0, progress=False)


def test_draft_with_every_layer_is_the_target():
    target = tiny_model(0)
    batch = TOKENS[:33].view(1, -1)
    torch.testing.assert_close(logits_of(draft_from_target(target, [0, 1]), batch), logits_of(target, batch))
    draft = draft_from_target(target, [1])
    assert draft.config.n_layers == 1 and not draft.tok_embeddings.weight.requires_grad
    assert draft.layers[0].attention.wqkv.weight.requires_grad
    torch.testing.assert_close(draft.layers[0].feed_forward.w2.weight, target.layers[1].feed_forward.w2.weight)
    with pytest.raises(ValueError, match="layers"):
        draft_from_target(target, [5])


def distilled(seed: int, steps: int):
    target = tiny_model(0).requires_grad_(False)
    draft = draft_from_target(target, [0])
    torch.manual_seed(seed)
    batches = torch.Generator().manual_seed(seed)
    losses = train(
        draft,
        lambda step: distill_loss(draft, target, random_windows(TOKENS, 4, 32, batches)),
        LoopConfig(steps=steps, lr=3e-3, **QUIET),
        desc="test",
    )
    return target, draft, losses


def test_distillation_lowers_held_out_kl_and_is_reproducible():
    target, draft, _ = distilled(seed=1, steps=40)
    held_out = random_windows(TOKENS, 8, 32, torch.Generator().manual_seed(99))
    untrained = draft_from_target(target, [0])
    with torch.no_grad():
        assert float(distill_loss(draft, target, held_out)) < 0.9 * float(distill_loss(untrained, target, held_out))
    assert (
        agreement(draft, target, held_out)["expected_acceptance"]
        > agreement(untrained, target, held_out)["expected_acceptance"]
    )
    _, again, _ = distilled(seed=1, steps=40)
    for a, b in zip(draft.parameters(), again.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qkv_bias,tie", [(False, True), (True, False)])
def test_checkpoint_reloads_exactly(tmp_path, tiny_tokenizer, qkv_bias, tie):
    model = tiny_model(3, qkv_bias=qkv_bias, tie_embeddings=tie)
    save_checkpoint(model, tiny_tokenizer, tmp_path / "ckpt")
    loaded = load_model({"path": str(tmp_path / "ckpt")}, torch.float32, torch.device("cpu"), 256)
    batch = TOKENS[:20].view(1, -1)
    torch.testing.assert_close(logits_of(loaded.model, batch), logits_of(model, batch))
    assert loaded.tokenizer.eos_ids == tiny_tokenizer.eos_ids
    assert loaded.tokenizer.encode("hello") == tiny_tokenizer.encode("hello")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(batch).logits, logits_of(model, batch), atol=1e-4, rtol=1e-4)


def test_scratch_tokenizer_and_models():
    text = "To be, or not to be, that is the question. " * 50 + "Whether 'tis nobler in the mind to suffer."
    tokenizer = train_tokenizer([text], vocab_size=300)
    assert tokenizer.decode(tokenizer.encode("not to be, ünïcode")) == "not to be, ünïcode"  # byte-level: no unknowns
    assert tokenizer.backend.token_to_id(EOS) in tokenizer.eos_ids and tokenizer.vocab_size <= 300
    ids = torch.tensor(tokenizer.encode(text))
    torch.manual_seed(0)
    model = init_model(
        dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64), tokenizer.vocab_size, 64, torch.device("cpu")
    )
    batches = torch.Generator().manual_seed(0)
    losses = train(
        model,
        lambda step: lm_loss(model, random_windows(ids, 8, 16, batches)),
        LoopConfig(steps=30, lr=1e-2, **QUIET),
        desc="test",
    )
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.slow
def test_inferlab_train_scratch_pair_serves_spec_draft(tmp_path):
    """The CLI end to end at toy size: corpus -> BPE -> target + draft -> load_engine(spec=draft) == spec off."""
    import subprocess
    import sys

    from inferlab.api import load_engine

    tiny = (
        "scratch.vocab_size=400 scratch.seq_len=32 scratch.batch_size=4 scratch.max_seq_len=128 "
        "scratch.target.dim=32 scratch.target.n_layers=2 scratch.target.hidden_dim=64 "
        "scratch.target_loop.steps=3 scratch.draft_loop.steps=2 scratch.target_loop.warmup=1 "
        "scratch.draft_loop.warmup=1 scratch.draft.dim=16 scratch.draft.hidden_dim=32"
    ).split()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferlab.train",
            "task=scratch",
            f"out={tmp_path}",
            "progress=false",
            f"hydra.run.dir={tmp_path}/run",
            *tiny,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "target" / "config.json").is_file() and (tmp_path / "draft" / "config.json").is_file()
    common = {"model.path": str(tmp_path / "target"), "cache.max_seq_len": 128}
    plain = load_engine(model="local", **common).generate("To be, or not", max_new_tokens=12)
    spec = load_engine(
        model="local", spec="draft", **common, **{"spec.draft_model": str(tmp_path / "draft"), "spec.k": 3}
    )
    assert spec.generate("To be, or not", max_new_tokens=12).token_ids == plain.token_ids
