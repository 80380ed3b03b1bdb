"""What every Hydra console script shares: the conf/ location and one-line errors instead of tracebacks."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from inferlab.errors import InferlabError
from inferlab.paths import conf_dir


def hydra_app(config_name: str) -> Callable[[Callable[[DictConfig], None]], Callable[[], None]]:
    """Wrap `run(cfg)` as a console-script entry point over conf/<config_name>.yaml."""

    def wrap(run: Callable[[DictConfig], None]) -> Callable[[], None]:
        @functools.wraps(run)
        def guarded(cfg: DictConfig) -> None:
            try:
                run(cfg)
            except (InferlabError, OmegaConfBaseException) as e:
                print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
                sys.exit(2)
            except KeyboardInterrupt:
                sys.exit(130)

        return hydra.main(config_path=str(conf_dir()), config_name=config_name, version_base=None)(guarded)

    return wrap
