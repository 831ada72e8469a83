"""The shared-weights folder of one ``kvrelay serve`` deployment.

Worker processes on one device that host the same model version map one copy of its weights, found through
a registry folder (shared/worker/shared_weights.py). Serve gives its workers a folder of their own instead of
the host-wide default, so two deployments on one host never map each other's weights: on a GPU an importer
cannot outlive its exporter's memory, so stopping one deployment (a blue/green switch on one machine) would
make the other's workers exit and reload, losing their requests in flight. A deployment's own prefill and
decode workers still share one copy. ``--share-weights-dir`` (or ``$KVRELAY_SHARE_WEIGHTS_DIR``) names a
folder to share across deployments on purpose, and is left as given.

The folder is named for serve's process (pid and start time, as the registry tells live processes), removed
when serve exits after its workers, and one whose serve is gone (killed with -9: its workers die with it) is
removed by the next serve on the host, since CPU arenas are files in /dev/shm that hold memory until unlinked.
"""

import contextlib
import logging
import shutil
from pathlib import Path

from kvrelay.shared.worker.weight_registry import Proc, default_dir

log = logging.getLogger("kvrelay.serve")


def deployment_dir(proc: Proc) -> Path:
    base = default_dir()
    return base.with_name(f"{base.name}-serve-{proc.pid}-{proc.start}")


def owner(folder: Path) -> Proc | None:
    """The serve process a deployment folder is named for; None for a name that is not one."""
    prefix = f"{default_dir().name}-serve-"
    pid, _, start = folder.name.removeprefix(prefix).partition("-")
    if not folder.name.startswith(prefix) or not (pid.isdigit() and start.lstrip("-").isdigit()):
        return None
    return Proc(int(pid), int(start))


def sweep() -> list[Path]:
    """Remove the folders of deployments whose serve is gone; returns them."""
    gone = []
    for folder in default_dir().parent.glob(f"{default_dir().name}-serve-*"):
        proc = owner(folder)
        if proc is not None and not proc.alive():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    if gone:
        log.info("removed %d shared-weights folder(s) of deployments that are gone", len(gone))
    return gone


def scope(configs: list, stack: contextlib.ExitStack) -> Path | None:
    """Give every worker config among ``configs`` that shares weights in the default folder this deployment's
    folder instead (removed as ``stack`` unwinds, after the workers stopped); None when none does."""
    wanted = [c for c in configs if getattr(c, "share_weights", False) and not c.share_weights_dir]
    if not wanted:
        return None
    sweep()
    folder = deployment_dir(Proc.me())
    stack.callback(shutil.rmtree, folder, True)
    for config in wanted:
        config.share_weights_dir = str(folder)
    return folder
