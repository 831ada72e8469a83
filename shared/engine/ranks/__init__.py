"""Tensor parallelism's process side: rank 0 (the engine's process) starts ranks 1..N-1 (``group``), each a
``rank_main`` process holding one model shard (``shard_runner``), and sends them every step's inputs
(``broadcast``). ``checks`` are the errors raised before anything starts."""
