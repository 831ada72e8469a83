"""Tensor parallelism's layer side: ``state`` is the group every sharded layer is handed, ``linear`` and
``embedding`` the shard math. The processes (starting ranks, the per-step broadcast) are in ../ranks/."""
