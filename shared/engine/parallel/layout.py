"""Where a global rank sits when a pipeline's stages are tensor-parallel groups: ranks
``stage * tp .. stage * tp + tp - 1`` form stage ``stage``'s group, so rank 0 is stage 0's first rank and
each rank hands its stage's output to the rank ``tp`` places on, which holds the same shard of the next
stage (activations are whole on every rank of a group after its all-reduce)."""

from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState, connect


@dataclass(frozen=True)
class RankLayout:
    rank: int
    tp: int
    pp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def next_peer(self) -> int:
        return self.rank + self.tp

    @property
    def prev_peer(self) -> int:
        return self.rank - self.tp

    @property
    def logits_sender(self) -> int:
        """The rank that sends rank 0 the last stage's logits (every rank of that stage forms them)."""
        return (self.pp - 1) * self.tp

    @property
    def stage_group(self) -> str:
        """The rendezvous name of this rank's stage group."""
        return f"rendezvous-stage{self.stage}"


def join_groups(layout: RankLayout, folder: Path, device: torch.device) -> tuple[ParallelState, ParallelState]:
    """(the whole group: pipeline send/recv, agreeing on KV blocks; the group the model's layers reduce
    over: the whole group without a pipeline, the stage's group in one, none for a stage of one rank)."""
    whole = connect(layout.rank, layout.world, folder, device)
    if layout.pp == 1:
        return whole, whole
    if layout.tp == 1:
        return whole, SINGLE
    return whole, connect(layout.tp_rank, layout.tp, folder, device, name=layout.stage_group)
