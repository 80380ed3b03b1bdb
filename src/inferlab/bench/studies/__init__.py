"""The studies: one module each, registered by name with `@register`.

A study takes the job's composed config and returns rows (flat dicts) that become result.json's `rows`
and the report's CSV. To add one: a module here, conf/study/NAME.yaml (its knobs and report section) and
sweeps/NAME.yaml (which groups vary). A feature that is not built yet raises `StudyUnavailable`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from inferlab.errors import InferlabError, InvalidRequestError

Rows = list[dict[str, Any]]
Study = Callable[[DictConfig], Rows]
REGISTRY: dict[str, Study] = {}


class StudyUnavailable(InferlabError):
    """The study needs a feature (module, config option, optional package) this checkout lacks."""

    code = "not_available"


def register(*names: str) -> Callable[[Study], Study]:
    def add(fn: Study) -> Study:
        for name in names:
            REGISTRY[name] = fn
        return fn

    return add


def discover() -> dict[str, Study]:
    """Import every module of this package so each registers its studies."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return REGISTRY


def run_study(cfg: DictConfig) -> Rows:
    studies = discover()
    name = cfg.study.name
    if name not in studies:
        raise InvalidRequestError(f"unknown study {name!r}; known: {', '.join(sorted(studies))}")
    return studies[name](cfg)
