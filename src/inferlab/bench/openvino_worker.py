"""OpenVINO GenAI's LLMPipeline on a GGUF file, timed for the peers studies; runs in a venv of its own (`make
openvino`), which has openvino-genai and numpy but not inferlab, so it imports neither inferlab nor torch.

    python openvino_worker.py FILE.gguf THREADS

First line out: {"version": ...}, or {"error": ...} where the pipeline cannot read the file. Then one JSON request a
line in, one answer a line out: {"ids": [...], "new_tokens": N} -> {"ttft_ms": ..., "tpot_ms": ...}, the pipeline's
own measurements of a greedy generation of exactly N tokens (EOS ignored) after those prompt ids.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    path, threads = sys.argv[1], int(sys.argv[2])
    try:
        pipe = og.LLMPipeline(path, "CPU", INFERENCE_NUM_THREADS=threads)
    except RuntimeError as error:  # a block format it does not read (BF16 files in 2026.4)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]  # the reason last, after paths
        print(json.dumps({"error": lines[-1] if lines else "cannot load"}), flush=True)
        return
    print(json.dumps({"version": og.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        ids = np.array([request["ids"]], dtype=np.int64)
        inputs = og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        n = int(request["new_tokens"])
        config = og.GenerationConfig(max_new_tokens=n, min_new_tokens=n, ignore_eos=True)
        metrics = pipe.generate(inputs, config).perf_metrics
        print(json.dumps({"ttft_ms": metrics.get_ttft().mean, "tpot_ms": metrics.get_tpot().mean}), flush=True)


if __name__ == "__main__":
    main()
