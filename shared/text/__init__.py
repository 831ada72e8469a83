"""Tokenizer loading and incremental detokenization: what the gateway and the offline engine
need of text. No torch."""
