"""One training loop for every task: AdamW, warmup + cosine decay, gradient clipping, a progress bar."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm import tqdm


@dataclass
class LoopConfig:
    steps: int
    lr: float
    weight_decay: float
    warmup: int  # steps of linear warmup before the cosine decay
    clip: float  # max gradient norm
    progress: bool = True


def train(model: nn.Module, next_loss: Callable[[int], Tensor], cfg: LoopConfig, desc: str) -> list[float]:
    """Minimize `next_loss(step)` over the trainable parameters of `model`; returns the loss of every step."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps))
    model.train()
    losses: list[float] = []
    with tqdm(range(cfg.steps), desc=desc, disable=not cfg.progress, dynamic_ncols=True) as bar:
        for step in bar:
            loss = next_loss(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, cfg.clip)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def lr_factor(step: int, warmup: int, steps: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # down to 10% of the peak
