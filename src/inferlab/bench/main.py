"""inferlab-bench: run a study job and write result.json; `-m sweep=NAME` runs sweeps/NAME.yaml as a multirun.

A sweep file names the study, fixed overrides and the swept ones (Hydra's `key=a,b,c`). Before Hydra starts,
`sweep=NAME` is expanded into those overrides (the user's own overrides of the same keys win); swept values
this checkout cannot compose yet (a missing config option) are recorded as "unavailable" results instead of
aborting the multirun. Every job catches its own failure and records it, so one bad job never stops a sweep.
"""
from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from inferlab.api import CONF_DIR, compose
from inferlab.bench.env import environment
from inferlab.bench.studies import StudyUnavailable, run_study
from inferlab.cli import hydra_app
from inferlab.errors import InferlabError, InvalidRequestError
from inferlab.paths import sweeps_dir

SWEEPS_DIR = sweeps_dir()
RESULT_FILE = "result.json"
_ABSENT = object()


def main() -> None:
    try:
        args = expand_sweep(sys.argv[1:])
    except InferlabError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args is None:
        return
    sys.argv = [sys.argv[0], *args]
    bench_job()


@hydra_app("bench")
def bench_job(cfg: DictConfig) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the progress bars
    result = run_job(cfg)
    where = Path(HydraConfig.get().runtime.output_dir) / RESULT_FILE
    detail = f": {result['error']}" if result["error"] else f" ({len(result['rows'])} rows, {result['seconds']:.1f} s)"
    print(f"[{result['status']}] {result['study']} {' '.join(result['overrides'])}{detail} -> {where}", file=sys.stderr)


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured study and write result.json; a failure is recorded, never raised."""
    hydra = HydraConfig.get()
    out = Path(hydra.runtime.output_dir)
    start = time.perf_counter()
    rows, status, error = [], "ok", None
    try:
        rows = run_study(cfg)
    except StudyUnavailable as e:
        status, error = "unavailable", str(e)
    except Exception as e:  # recorded so the multirun goes on; the traceback goes beside result.json
        status, error = "error", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "error.log").write_text(traceback.format_exc())
    result = {
        "study": cfg.study.name, "sweep": cfg.sweep, "status": status, "error": error,
        "seconds": time.perf_counter() - start, "overrides": list(hydra.overrides.task),
        "choices": {k: v for k, v in hydra.runtime.choices.items() if not k.startswith("hydra")},
        "config": OmegaConf.to_container(cfg, resolve=True), "env": environment(), "rows": rows,
    }
    write_result(out, result)
    return result


def write_result(directory: Path, result: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RESULT_FILE).write_text(json.dumps(result, indent=1, default=str) + "\n")


def override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def expand_sweep(args: list[str]) -> list[str] | None:
    """Replace `sweep=NAME` by the sweep's overrides; None when nothing is left to run."""
    named = [a for a in args if override_key(a) == "sweep"]
    if not named:
        return args
    name = named[-1].split("=", 1)[1]
    path = SWEEPS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml")))
        raise InvalidRequestError(f"no sweep {name!r} in {SWEEPS_DIR}; known: {known}")
    spec = yaml.safe_load(path.read_text())
    user = [a for a in args if override_key(a) != "sweep"]
    taken = {override_key(a) for a in user if not a.startswith("-")}
    fixed = [f"{k}={_yaml_value(v)}" for k, v in {"study": spec["study"], **spec.get("fixed", {})}.items() if k not in taken]
    params = {k: [s.strip() for s in str(_yaml_value(v)).split(",")] for k, v in spec.get("params", {}).items()
              if k not in taken}
    base = [*fixed, *(first_value(a) for a in user if not a.startswith(("-", "hydra."))), f"sweep={name}"]
    available, missing = split_available(params, base)
    if missing:
        record_unavailable(name, spec["study"], missing, base)
    if any(not values for values in available.values()):
        print(f"sweep {name}: nothing to run; {len(missing)} value(s) unavailable", file=sys.stderr)
        return None
    swept = [f"{k}={','.join(v)}" for k, v in available.items()]
    flags = [] if {"-m", "--multirun"} & set(user) else ["--multirun"]
    return [*flags, *user, *fixed, *swept, f"sweep={name}"]


def split_available(params: dict[str, list[str]], base: list[str]) -> tuple[dict[str, list[str]], list[tuple[str, str, str]]]:
    """Keep the values this checkout can compose: a group option with a config file, a key that exists."""
    groups = {k for k in params if (CONF_DIR / k).is_dir()}
    first = [f"{k}={v[0]}" for k, v in params.items() if k in groups and (CONF_DIR / k / f"{v[0]}.yaml").is_file()]
    cfg = compose("bench", [*base, *first])
    available: dict[str, list[str]] = {}
    missing: list[tuple[str, str, str]] = []
    for key, values in params.items():
        if key in groups:
            available[key] = [v for v in values if (CONF_DIR / key / f"{v}.yaml").is_file()]
            missing += [(key, v, f"{key}={v} is not available yet: no conf/{key}/{v}.yaml") for v in values
                        if v not in available[key]]
        elif OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
            available[key] = []
            missing += [(key, v, f"{key} is not available yet: no such config key") for v in values]
        else:
            available[key] = values
    return available, missing


def record_unavailable(sweep: str, study: str, missing: list[tuple[str, str, str]], base: list[str]) -> None:
    root = Path(compose("bench", base).results_root)
    env = environment()
    for key, value, reason in missing:
        result = {"study": study, "sweep": sweep, "status": "unavailable", "error": reason, "seconds": 0.0,
                  "overrides": [f"{key}={value}"], "choices": {}, "config": {}, "env": env, "rows": []}
        write_result(root / "multirun" / sweep / "unavailable" / f"{key}={value}", result)
        print(f"[unavailable] {study} {key}={value}: {reason}", file=sys.stderr)


def first_value(arg: str) -> str:
    """`key=a,b` (a sweep) -> `key=a`, so one representative config can be composed."""
    key, _, value = arg.partition("=")
    return arg if value.startswith(("[", "{", "'", '"')) else f"{key}={value.split(',')[0]}"


def _yaml_value(value: Any) -> Any:
    """YAML reads `off`/`false` as booleans; Hydra overrides want the words."""
    return str(value).lower() if isinstance(value, bool) else value


if __name__ == "__main__":
    main()
