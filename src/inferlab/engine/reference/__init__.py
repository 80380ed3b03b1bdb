"""The seed's references, one request (or one static batch) at a time outside the engine loop.

single.py: one sequence's prefill and decode steps (`InferenceEngine.prefill` / `decode_step`, the contract), on a
contiguous slot, on paged blocks, or recomputed in full (cache=none, the baseline the KV-cache study measures
against); static_batch.py: B prompts left-padded into B contiguous slots and decoded together until the longest
ends. The engine loop never imports this room: it is what the loop's results are checked against, and what the
front door (engine/engine.py) routes to where its routing table says so.
"""
