"""Freezing long-lived objects, and the unload path that must still free a frozen model's cycles."""

import gc
import weakref

from kvrelay.shared.worker.gc_freeze import collect_all, freeze_long_lived


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_a_frozen_cycle_is_freed_by_the_unload_collection():
    try:
        obj = Node()
        ref = weakref.ref(obj)
        freeze_long_lived()
        assert gc.get_freeze_count() > 0
        del obj
        gc.collect()
        assert ref() is not None  # frozen: a plain collection leaves it
        collect_all()
        assert ref() is None
        assert gc.get_freeze_count() > 0  # survivors are frozen again
    finally:
        gc.unfreeze()


def test_without_a_freeze_it_is_a_plain_collection():
    gc.unfreeze()
    obj = Node()
    ref = weakref.ref(obj)
    del obj
    collect_all()
    assert ref() is None and gc.get_freeze_count() == 0


def test_workers_freeze_and_library_engines_do_not(tmp_path):
    from kvrelay.cli import build_parser
    from kvrelay.workers import worker_config

    args = build_parser().parse_args(["decode-worker", "--model", "dummy:tiny-llama", "--device", "cpu"])
    assert worker_config("decode", args).freeze_gc
    from kvrelay.shared.config.worker import WorkerConfig

    assert WorkerConfig.__dataclass_fields__["freeze_gc"].default is False
