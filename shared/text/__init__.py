"""Tokenizer loading and incremental detokenization: what the gateway and the offline engine
need of text; beam search's bookkeeping over token sequences (``beam_scoring.py``), which both run
too (the API's search over the workers, the engine's offline); and the labelled progress bars every
process writes to the terminal. No torch."""
