"""`sweeps/` as Hydra's `sweep` config group.

The project's top level keeps the studies in `sweeps/` (beside conf/), while Hydra names a config group
after its folder. This config source serves `sweeps/NAME.yaml` as `sweep/NAME`; conf/bench.yaml puts it on
the search path (`hydra.searchpath: [inferlab-sweeps://]`), so `inferlab-bench sweep=NAME` selects a sweep
the way any other group option is selected.
"""

from __future__ import annotations

import builtins

from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource

GROUP = "sweep"


class SweepsConfigSource(ConfigSource):
    """The folder after `inferlab-sweeps://` (empty: inferlab's own sweeps/), seen as the one group `sweep`."""

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider, path)
        if not self.path:
            from inferlab.paths import sweeps_dir

            self.path = str(sweeps_dir())
        self.folder = FileConfigSource(provider, self.path)

    @staticmethod
    def scheme() -> str:
        return "inferlab-sweeps"

    @staticmethod
    def _inside(config_path: str) -> str | None:
        """`sweep/NAME` -> `NAME`, `sweep` -> ``; None for a path outside the group."""
        head, _, rest = config_path.strip("/").partition("/")
        return rest if head == GROUP else None

    def load_config(self, config_path: str) -> ConfigResult:
        inside = self._inside(config_path)
        if not inside:
            raise ConfigLoadError(f"Config not found : {config_path}")
        return self.folder.load_config(inside)

    def available(self) -> bool:
        return self.folder.available()

    def is_group(self, config_path: str) -> bool:
        inside = self._inside(config_path)
        return config_path.strip("/") == "" or (inside is not None and self.folder.is_group(inside))

    def is_config(self, config_path: str) -> bool:
        inside = self._inside(config_path)
        return bool(inside) and self.folder.is_config(inside)

    def list(self, config_path: str, results_filter: ObjectType | None) -> builtins.list[str]:
        if config_path.strip("/") == "":
            return [GROUP] if results_filter in (None, ObjectType.GROUP) else []
        inside = self._inside(config_path)
        return [] if inside is None else self.folder.list(inside, results_filter)
