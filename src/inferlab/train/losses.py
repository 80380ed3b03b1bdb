"""Training objectives: next-token cross-entropy, and distillation towards a teacher's distributions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from inferlab.model.transformer import Transformer


def positions_for(tokens: Tensor) -> Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)


def lm_loss(model: Transformer, batch: Tensor) -> Tensor:
    """Cross-entropy of each next token; batch (B, T+1)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs, positions_for(inputs))  # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def distill_loss(student: Transformer, teacher: Transformer, batch: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(teacher || student) per position: what raises the acceptance rate min(1, p/q) on average.

    Speculative acceptance at a position is 1 - TV(p, q); forward KL bounds TV (Pinsker) and, unlike
    cross-entropy on the data, pulls the draft towards the target's own mistakes too.
    """
    inputs = batch[:, :-1]
    positions = positions_for(inputs)
    with torch.no_grad():
        p_log = F.log_softmax(teacher(inputs, positions).float() / temperature, dim=-1)
    q_log = F.log_softmax(student(inputs, positions).float() / temperature, dim=-1)
    return F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="batchmean")


@torch.no_grad()
def agreement(student: Transformer, teacher: Transformer, batch: Tensor) -> dict[str, float]:
    """Held-out numbers that predict speculation: greedy top-1 agreement and the mean expected acceptance 1 - TV."""
    inputs = batch[:, :-1]
    positions = positions_for(inputs)
    p = torch.softmax(teacher(inputs, positions).float(), dim=-1)
    q = torch.softmax(student(inputs, positions).float(), dim=-1)
    top1 = (p.argmax(-1) == q.argmax(-1)).float().mean()
    accept = 1 - 0.5 * (p - q).abs().sum(-1).mean()
    return {"greedy_agreement": float(top1), "expected_acceptance": float(accept)}
