"""Speculative decoding: cheap drafts of the next K tokens, verified by the target in one forward, lossless.

acceptance.py: the rule that keeps every token distributed as the target alone would sample it;
proposers.py: the drafter interfaces and n-gram prompt lookup; draft_model.py: a draft model and the one loop that
drafts with it, for one sequence or a whole step's; session.py: one request speculating alone (and
`speculative_generate`, the contract), and what the engine holds for spec=ngram|draft|self; in_loop.py: speculation
inside the engine loop, every decoding sequence's drafts verified in the step's one forward; adaptive_k.py: how many
tokens to draft, from acceptance and timed costs; calibration.py: those costs timed at load; build.py: the `spec`
config group -> the drafter.
"""
