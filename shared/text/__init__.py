"""Tokenizer loading and incremental detokenization: what the gateway and the offline engine
need of text, and the labelled progress bars every process writes to the terminal. No torch."""
