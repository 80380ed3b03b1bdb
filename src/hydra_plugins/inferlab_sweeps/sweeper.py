"""Hydra's basic sweeper, except that a job this checkout cannot compose yet (a config option or key that
is not there, e.g. a sweep value another branch adds) is recorded as an "unavailable" result.json in the
sweep's `unavailable/` folder instead of aborting the whole multirun."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError


class InferlabSweeper(BasicSweeper):
    def split_arguments(self, overrides: list[Override], max_batch_size: int | None) -> list[list[list[str]]]:  # type: ignore[override]
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        runnable, missing = [], []
        for job in jobs:
            reason = self._cannot_compose(job)
            (missing if reason else runnable).append((job, reason))
        if missing:
            self._record(missing)
        runnable_jobs = [job for job, _ in runnable]
        if not runnable_jobs:
            return []
        return list(BasicSweeper.split_overrides_to_chunks(runnable_jobs, max_batch_size))

    def _cannot_compose(self, job: list[str]) -> str | None:
        assert self.hydra_context is not None and self.config is not None
        try:
            self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
        except (MissingConfigException, ConfigCompositionException) as e:
            first = (str(e).strip() or type(e).__name__).splitlines()[0]
            cause = e.__cause__ or e.__context__
            return first + (
                " (no such config key)" if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) else ""
            )
        return None

    def _record(self, missing: list[tuple[list[str], str | None]]) -> None:
        from inferlab.bench.results import unavailable_result, write_result  # only when a sweep needs it

        assert self.config is not None
        folder = Path(str(self.config.hydra.sweep.dir)) / "unavailable"
        sweep = self.config.hydra.runtime.choices.get("sweep")
        for number, (job, reason) in enumerate(missing):
            result = unavailable_result(str(self.config.study.name), sweep, job, f"not available yet: {reason}")
            write_result(folder / str(number), result)
            print(f"[unavailable] {result['study']} {' '.join(job)}: {reason}", file=sys.stderr)
