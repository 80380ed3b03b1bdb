"""KV memory: where the keys and values of every sequence live, and who holds which part of it.

contiguous.py: pre-allocated slots of max_seq_len positions (KVCache, the seed's contract) and the slot pool;
paged.py: one pool of fixed-size blocks read and written through block tables; block_manager.py: which
sequence holds which blocks; prefix_cache.py: full blocks found again by the tokens they hold; int8.py: KV rows
as int8 codes and a scale. Nothing here runs a model: the forwards that fill this memory are the model runner's
(engine/model_runner.py).
"""
