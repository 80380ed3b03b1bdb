"""inferlab-generate prompt="...": stream one completion to stdout; TTFT, TPOT and tokens/s to stderr."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.cli import hydra_app


@hydra_app("generate")
def main(cfg: DictConfig) -> None:
    engine = engine_from_config(cfg)
    stats = engine.load_stats
    print(
        f"[loaded {engine.loaded.source} in {stats['load_s']:.1f} s: peak RSS {stats['load_peak_rss_mb']:.0f} MiB "
        f"while loading, {stats['load_rss_mb']:.0f} MiB after]",
        file=sys.stderr,
    )
    params = engine.sampling_params()
    prompt_ids = engine.encode_prompt(str(cfg.prompt), chat=bool(cfg.chat))
    for event in engine.iter_events(prompt_ids, params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        if event.timings is not None:
            t = event.timings
            sys.stdout.write("\n")
            print(
                f"[{engine.loaded.source} {cfg.precision.name} cache={cfg.cache.mode} on {engine.config.device}] "
                f"prompt {t.prompt_tokens} tok, generated {t.completion_tokens} tok ({event.finish_reason}) | "
                f"TTFT {t.ttft_ms:.1f} ms | TPOT {t.tpot_ms:.1f} ms | {t.tokens_per_sec:.1f} tok/s",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
