"""Keep Python's cyclic garbage collector off the engine's long-lived objects.

A decode step allocates a few hundred short-lived objects per running request, so generation-0
collections run every step or two and, every hundred or so, a full collection walks every tracked object:
the model's modules and parameters, tokenizers, imported libraries. At batch 128 on the tiny model that
cost ~350 us of each step on the 2-core CPU (``python -m bench.engine_step``). So, as vLLM's engine
processes do, a worker moves what exists once a model is loaded to the permanent generation. Only
processes that are ours alone do it (workers, benchmarks): frozen objects that later die in a reference
cycle are never collected, which a library user's process must not inherit. A model unload thaws first,
or the model's own cycles, frozen with it, would keep their GPU memory.
"""

import gc


def freeze_long_lived() -> None:
    """Collect what is garbage now, then exempt every surviving object from future collections."""
    gc.collect()
    gc.freeze()


def collect_all() -> None:
    """A full collection that includes frozen objects (after an unload); survivors are frozen again."""
    if not gc.get_freeze_count():
        gc.collect()
        return
    gc.unfreeze()
    freeze_long_lived()
