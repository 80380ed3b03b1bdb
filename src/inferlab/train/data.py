"""Training batches: random windows of a flat token stream, drawn from a seeded generator."""

from __future__ import annotations

import torch
from torch import Tensor


def random_windows(tokens: Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """(batch_size, seq_len + 1) windows of `tokens` (N,): inputs are [:, :-1], next-token targets [:, 1:]."""
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"corpus of {tokens.numel()} tokens is shorter than one window of {seq_len + 1}")
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
