"""python -m inferlab.bench.decode_probe OVERRIDES... < request.json: batch-1 decode tok/s of a fresh engine.

For a study that decodes under a condition its own process cannot be put in once started (a CPU quota, an affinity
mask: OpenMP and the engine size their threads from the CPUs a process has at start), so it starts this inside the
condition. The engine is built from conf/engine.yaml with OVERRIDES (Hydra's syntax, as inferlab-serve takes them)
and generates through its loop as inferlab-generate does, greedy, EOS ignored; each generation is timed by the
engine's own timings (Timings.tokens_per_sec: 1000 / TPOT). stdin: {"prompt_ids": [...], "new_tokens": N,
"warmup": W, "repeats": R}; stdout's last line: {"decode_tok_s": the median over R generations after W untimed
ones, "threads": torch's intra-op threads}.
"""

from __future__ import annotations

import json
import sys

import torch

from inferlab.api import compose, engine_from_config
from inferlab.bench.studies.common import median_of
from inferlab.engine.engine import InferenceEngine


def decode_tok_s(engine: InferenceEngine, prompt_ids: list[int], new_tokens: int) -> float:
    params = engine.sampling_params(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    closing = None
    for closing in engine.iter_events(prompt_ids, params):
        pass
    if closing is None or closing.timings is None:
        raise RuntimeError("the engine closed the request without its timings")
    return closing.timings.tokens_per_sec


def main() -> None:
    request = json.loads(sys.stdin.read())
    engine = engine_from_config(compose("engine", sys.argv[1:]))
    try:
        rate = median_of(
            lambda: decode_tok_s(engine, request["prompt_ids"], int(request["new_tokens"])),
            int(request["warmup"]),
            int(request["repeats"]),
        )
    finally:
        engine.close()
    print(json.dumps({"decode_tok_s": rate, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
