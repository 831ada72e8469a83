"""What crosses a process boundary: every message and its msgpack codec, Redis keys, connections and
the job streams' consumer (``job_queue.py``), sampling parameters, the block hashes both sides key prefix
caches by (``block_hash.py``) and where prefixes went by them (``prefix_affinity.py``). The only layer the
gateway shares with the workers."""
