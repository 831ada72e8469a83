"""What crosses a process boundary: every message and its msgpack codec, Redis keys, connections and
the job streams' consumer (``job_queue.py``), sampling parameters, the block hashes both sides key prefix
caches by (``block_hash.py``) and where prefixes went by them (``prefix_affinity.py``). The bottom layer:
it imports no other of kvrelay's, so every process may import it.

The gateway talks to the workers only through what is here, but it is not the only layer the gateway imports: it
also takes config (its own typed settings), text (it tokenizes, detokenizes, matches stop strings and scores the
API's beam search itself) and repo (the admin API resolves the models it registers, by name and version, in the
repository). What pyproject's contract "the gateway imports no torch, engine, handoff or worker runtime" keeps out
is the engine, handoff, the worker runtime, kernels, torch and triton, directly or through another module: so what
the gateway imports of config, text and repo must reach none of them either (the repository's GGUF converter, which
loads torch, is reached only from kvrelay/ (the CLI, serve, LLM), never from the gateway)."""
