"""The small thread pool that stages, CRCs or MACs, checks and writes KV frames off the workers' main loops
(numpy, torch, zlib and OpenSSL release the GIL), so a 268 MB transfer stalls neither worker; the loops only
hand messages to and from the sockets."""

import os
from concurrent.futures import Future, ThreadPoolExecutor

# enough threads to keep the frames' MAC off the critical path, few enough to leave the engine's own
# threads alone: HMAC-SHA256 runs at about a third of CRC32's speed a core, so a MAC'd frame stream (a
# CURVE deployment's default) needs about twice the cores that CRC'd frames did to keep up with one
# socket. Threads only run while frames are staged or checked; a small host keeps one a core
_POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="kv-transfer")
# below this a transfer is staged / checked and written on the calling thread: a pool round trip
# (two thread wake-ups) costs more than the ~0.3 ms of work, and there is nothing to overlap
INLINE_BYTES = 1 << 20


def submit(inline: bool, fn, *args) -> Future:
    """``fn(*args)`` on the pool or, ``inline``, at once on this thread; its result or error is the future's."""
    if not inline:
        return _POOL.submit(fn, *args)
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # delivered through the future, exactly as from the pool
        future.set_exception(exc)
    return future
