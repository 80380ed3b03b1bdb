"""Training: offline corpora -> tokens -> a draft for a real target, or a from-scratch target/draft pair."""
