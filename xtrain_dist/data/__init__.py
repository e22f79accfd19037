"""Token ids to train on: a text and its tokenizer (corpus), llm.c token files (token_files), and the
global batch every rank draws alike (sampler)."""
