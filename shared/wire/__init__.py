"""What crosses a process boundary: every message and its msgpack codec, Redis keys and
connections, sampling parameters. The only layer the gateway shares with the workers."""
