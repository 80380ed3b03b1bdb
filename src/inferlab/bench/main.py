"""inferlab-bench: run a study job and write result.json; `-m sweep=NAME` runs sweeps/NAME.yaml as a multirun.

A sweep is a Hydra config (the `sweep` group, served from sweeps/ by hydra_plugins/inferlab_sweeps): its
study and fixed choices as defaults overrides, what varies as `hydra.sweeper.params`, read by Hydra's own
sweeper. Every job catches its own failure and records it, so one bad job never stops a sweep; a job this
checkout cannot compose yet is recorded as "unavailable" by the sweeper.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from inferlab.bench.env import environment
from inferlab.bench.results import write_result
from inferlab.bench.studies import StudyUnavailable, run_study
from inferlab.cli import hydra_app


@hydra_app("bench")
def main(cfg: DictConfig) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the progress bars
    # `kill` unwinds like Ctrl-C: the servers a study started (some paused by SIGSTOP) are stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = run_job(cfg)
    where = Path(HydraConfig.get().runtime.output_dir)
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
    choices = {k: v for k, v in hydra.runtime.choices.items() if not k.startswith("hydra")}
    result = {
        "study": cfg.study.name,
        "sweep": choices.get("sweep"),
        "status": status,
        "error": error,
        "seconds": time.perf_counter() - start,
        "overrides": list(hydra.overrides.task),
        "choices": choices,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "env": environment(),
        "rows": rows,
    }
    write_result(out, result)
    return result


if __name__ == "__main__":
    main()
