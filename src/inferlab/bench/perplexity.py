"""Strided-window perplexity: how well a model predicts held-out text, the quality side of every speed trade.

Text longer than the window is scored in windows that advance by `stride`: each window scores only
its last `stride` tokens (the first window all but its first), with the rest as context, so every
token after the first is scored exactly once with at least `window - stride` tokens before it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferlab.bench.progress import progress
from inferlab.errors import InvalidRequestError


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, first_scored, end) per forward: ids[begin:end] go in, ids[first_scored:end] are scored."""
    spans, scored = [], 1
    while scored < n_tokens:
        end = min(max(scored + stride, window), n_tokens)
        spans.append((max(0, end - window), scored, end))
        scored = end
    return spans


@torch.inference_mode()
def evaluate_perplexity(model: nn.Module, token_ids: Tensor | list[int], window: int, stride: int) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] under `model` (a Transformer: tokens, positions -> logits)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if ids.numel() < 2:
        raise InvalidRequestError("perplexity needs at least 2 tokens")
    if not 1 <= stride < window:
        raise InvalidRequestError(f"perplexity needs 1 <= stride < window (got window={window}, stride={stride})")
    max_len = getattr(getattr(model, "config", None), "max_seq_len", window)
    if window > max_len:
        raise InvalidRequestError(f"perplexity window={window} exceeds the model's context of {max_len} tokens")
    ids = ids.to(next(model.parameters()).device)
    total = 0.0
    for begin, first, end in progress(windows(ids.numel(), window, stride), "perplexity windows"):
        chunk = ids[begin:end].unsqueeze(0)  # (1, T)
        logits = model(chunk, torch.arange(end - begin, device=ids.device).unsqueeze(0))[0]  # (T, vocab)
        total += F.cross_entropy(
            logits[first - begin - 1 : end - begin - 1].float(), ids[first:end], reduction="sum"
        ).item()
    return math.exp(total / (ids.numel() - 1))
