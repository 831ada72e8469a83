"""The process of one tensor-parallel rank (or pipeline stage) other than 0: ``python -m kvrelay.shared.engine.ranks.rank_main
RANK WORLD FOLDER PARENT_PID ROOT DEATHSIG``, its RankConfig (rank_config.py) as JSON on stdin (never argv, never pickle). Joins the
group, loads its shard of the weights, and runs rank 0's steps until told to stop or rank 0 is gone."""

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from kvrelay.shared.config import handover
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.parallel.layout import RankLayout, join_groups
from kvrelay.shared.engine.ranks.broadcast import StepReceiver
from kvrelay.shared.engine.ranks.group import rank_device
from kvrelay.shared.engine.ranks.kv_inlet import Inlet, share_of
from kvrelay.shared.engine.ranks.kv_parts import PartSender
from kvrelay.shared.engine.ranks.rank_config import RankConfig
from kvrelay.shared.engine.ranks.shard_runner import ShardRunner

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the thread that started it (rank 0's main thread) ends,
    however rank 0 ends."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # elsewhere the idle loop's parent check is what ends it


def main(argv: list[str] | None = None) -> int:
    args = argv or sys.argv[1:]
    rank, world, folder, parent = int(args[0]), int(args[1]), args[2], int(args[3])
    root = Path(args[4]) if args[4] else None  # the model repository, if it is one's
    if args[5] == "1":  # started by rank 0's main thread (see group.py _long_lived_thread)
        _die_with_parent()
    if os.getppid() != parent:
        return 1  # rank 0 died before the signal was armed
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    handed = handover.receive(RankConfig, sys.stdin)
    config = handed.engine
    device = rank_device(config.device, rank)
    receiver = StepReceiver(Path(folder), rank)
    layout = RankLayout(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    if layout.world != world:
        raise ValueError(f"rank {rank}: a group of {world} ranks, but its config makes {layout.world}")
    state, model_state = join_groups(layout, Path(folder), device)
    model, _ = load_model(config.model, device, progress=False, root=root, parallel=model_state,
                          pipeline=(layout.stage, layout.pp))
    links = handed.links
    parts = PartSender(links) if links is not None else None
    inlet = None
    if links is not None and links.inlet_host is not None:  # a decode group: this rank takes its own share
        share = share_of(model, layout)
        inlet = Inlet(rank, links.keys(), links.inlet_host, Path(folder), (share.layers[0], share.heads[0]),
                      links.inlet_advertise)
    ShardRunner(model, config, state, device, layout, handed.kv_scales, parts, inlet).serve(receiver, parent)
    receiver.close()
    if parts is not None:
        parts.close()
    if inlet is not None:
        inlet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
