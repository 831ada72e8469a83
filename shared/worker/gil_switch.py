"""While a model loads on a side thread, the serving loop gets the GIL back within a short switch interval.

A load's Python (module construction, weight conversion, graph capture, warm-up) runs on its own thread. Each
time the serving loop lets the GIL go (a CUDA sync, a socket poll, a copy that releases it) and then wants it
back, CPython makes it wait until the loader's switch interval runs out: 5 ms by default, paid at every such
point of every step of every co-resident model. A shorter interval while loads run bounds that wait. The
loader loses nothing it would not lose anyway: it gives the GIL up only when another thread asks for it.
(`python -m kvrelay.bench.gil_switch` measures both sides on a toy loop.)
"""

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

LOAD_SWITCH_INTERVAL_S = 0.0002

_lock = threading.Lock()
_active = 0
_saved = 0.0


@contextmanager
def short_switches(interval_s: float = LOAD_SWITCH_INTERVAL_S) -> Iterator[None]:
    """The process's switch interval at most ``interval_s`` while any caller is inside; restored by the last."""
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, interval_s))
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                sys.setswitchinterval(_saved)
