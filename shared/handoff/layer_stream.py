"""A prompt's KV leaving layer by layer while the forward that computes its last chunk runs (the transfers
are shared/handoff/sender.py's)."""

from collections.abc import Callable

from kvrelay.shared.handoff.states import State
from kvrelay.shared.handoff.transfer import Transfer

BeginStream = Callable[[str, str, list[int]], Transfer | None]  # (request id, instance, its blocks) -> streaming


class LayerStream:
    """The connector's worker-side half for one model (a ``LayerSaver``, shared/engine/kv_connector.py, set
    through ``EngineCore.kv.set_layer_saver``): the forward calls ``begin`` with
    the requests whose prompt's last chunk the forward computes, ``layer_done`` after each decoder
    layer, ``end`` once the forward is queued. Transfers holding a fresh early grant move each group of
    layers as soon as the forward has written it."""

    def __init__(self, begin_stream: BeginStream, pump: Callable[[Transfer], None], instance: str):
        """``begin_stream``: the sender's transfer for a request whose prompt this forward finishes, if it
        holds a fresh grant; ``pump``: move a streaming transfer's staged layers out."""
        self.begin_stream, self.pump, self.instance = begin_stream, pump, instance
        self.streaming: list[Transfer] = []  # this forward's

    def begin(self, finishing: list[tuple[str, list[int]]]) -> bool:
        """``finishing``: (request id, its block ids). True when any layer is worth reporting."""
        self.streaming = [t for rid, blocks in finishing
                          if (t := self.begin_stream(rid, self.instance, blocks)) is not None]
        return bool(self.streaming)

    def layer_done(self, layer: int) -> None:
        for t in self.streaming:
            if t.state is State.STREAMING:
                t.sender.stage_through(layer)
                self.pump(t)  # on the CPU the forward is synchronous: send what is staged now

    def end(self) -> None:
        """Whatever the forward wrote and no hook reported (a model without per-layer hooks)."""
        for t in self.streaming:
            if t.state is State.STREAMING:
                t.sender.stage_through(t.sender.num_layers - 1)
        self.streaming = []
