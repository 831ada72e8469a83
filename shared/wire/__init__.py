"""What crosses a process boundary: every message and its msgpack codec, Redis keys, connections and
the job streams' consumer (``job_queue.py``), sampling parameters. The only layer the gateway shares
with the workers."""
