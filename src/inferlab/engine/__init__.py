"""The engine: requests in, tokens out, over one model and one KV memory.

At the top, a request's way: engine.py (the front door, with the routing table of which path serves which way in)
-> request.py (one request's state and the events it streams) -> scheduler.py (who runs this step, who waits, who is
preempted) -> loop.py (the step: schedule -> run -> sample -> stream) -> model_runner.py (every forward that writes
KV and returns logits) -> sampling.py, logits.py, grammar.py, stop.py (the next token, what a request's history and its grammar do to
it, the text it adds). Below them: kv/ (where the keys and values live), spec/ (speculative decoding), reference/ (the
seed's single-sequence path and left-padded static batch, what the loop is checked against), runtime/ (the loop's
CPUs and threads, its hand-off to asyncio, its step counters).
"""
