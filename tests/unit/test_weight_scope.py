"""kvrelay/weight_scope.py: a deployment's workers share weights in a folder of its own, removed as serve
stops, and the folders of deployments whose serve is gone are swept by the next one."""

import contextlib
import subprocess
import sys

from kvrelay import weight_scope
from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.worker.weight_registry import Proc, default_dir


def worker(**settings) -> WorkerConfig:
    return WorkerConfig("prefill", EngineConfig(ModelConfig("m"), device="cpu"), **settings)


def dead_proc() -> Proc:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return Proc(child.pid, 12345)


def test_workers_sharing_in_the_default_folder_get_the_deployments_own_and_it_goes_with_serve():
    default, explicit, private = worker(), worker(share_weights_dir="/tmp/x"), worker(share_weights=False)
    with contextlib.ExitStack() as stack:
        folder = weight_scope.scope([default, explicit, private], stack)
        assert folder == weight_scope.deployment_dir(Proc.me()) and folder.parent == default_dir().parent
        assert (default.share_weights_dir, explicit.share_weights_dir, private.share_weights_dir) == \
            (str(folder), "/tmp/x", None)
        folder.mkdir()  # as the first worker's registry does
    assert not folder.exists()


def test_nothing_is_scoped_when_no_worker_shares_in_the_default_folder():
    with contextlib.ExitStack() as stack:
        assert weight_scope.scope([worker(share_weights=False)], stack) is None


def test_the_folders_of_gone_deployments_are_swept_and_others_kept():
    gone = weight_scope.deployment_dir(dead_proc())
    live = weight_scope.deployment_dir(Proc.me())
    unrelated = default_dir().with_name(f"{default_dir().name}-serve-notes")
    for folder in (gone, live, unrelated):
        folder.mkdir(exist_ok=True)
        (folder / "seg-1").write_bytes(b"x")
    try:
        assert gone in weight_scope.sweep()
        assert not gone.exists() and live.exists() and unrelated.exists()
    finally:
        for folder in (gone, live, unrelated):
            for f in folder.glob("*"):
                f.unlink()
            if folder.exists():
                folder.rmdir()
