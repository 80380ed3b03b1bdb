"""inferlab-train task=draft|scratch: build the checkpoints speculative decoding uses, offline, from a seed."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from inferlab.api import resolve_device
from inferlab.cli import hydra_app
from inferlab.errors import InvalidRequestError

TASKS = ("draft", "scratch")


@hydra_app("train")
def main(cfg: DictConfig) -> None:
    if cfg.task not in TASKS:
        raise InvalidRequestError(f"unknown task {cfg.task!r}; use one of {list(TASKS)}")
    if cfg.device.threads:
        torch.set_num_threads(int(cfg.device.threads))
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device.name)
    if cfg.task == "draft":
        from inferlab.train.draft import train_draft

        train_draft(cfg, device)
    else:
        from inferlab.train.scratch import train_scratch

        train_scratch(cfg, device)


if __name__ == "__main__":
    main()
