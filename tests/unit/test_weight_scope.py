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


def test_a_benchmark_stack_shares_weights_in_a_folder_of_its_own_unless_one_is_given(tmp_path, monkeypatch):
    """kvrelay/local_cluster.py, what the multi-process benchmarks start: as serve's, its workers share weights
    only with each other, so a stack never maps another stack's on this host (one stopping would make the
    other's workers exit to reload); the folder goes when the stack stops; a folder named in the environment is
    every process's, as given."""
    from kvrelay.local_cluster import SHARE_WEIGHTS_ENV, LocalCluster

    monkeypatch.delenv(SHARE_WEIGHTS_ENV, raising=False)
    cluster = LocalCluster("redis://127.0.0.1:1", tmp_path)
    assert cluster.share_dir == weight_scope.deployment_dir(Proc.me()) != default_dir()
    assert cluster.env()[SHARE_WEIGHTS_ENV] == str(cluster.share_dir)
    cluster.share_dir.mkdir(parents=True)
    cluster.stop()
    assert not cluster.share_dir.exists()
    monkeypatch.setenv(SHARE_WEIGHTS_ENV, str(tmp_path / "chosen"))
    chosen = LocalCluster("redis://127.0.0.1:1", tmp_path)
    assert chosen.share_dir is None and chosen.env()[SHARE_WEIGHTS_ENV] == str(tmp_path / "chosen")
