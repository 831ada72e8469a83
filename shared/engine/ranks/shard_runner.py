"""What ranks 1..N-1 of a tensor-parallel group run: the model shard and its KV cache, driven by rank 0's
messages. Each step rebuilds from the packed inputs exactly the tensors rank 0 runs on and makes the
same sequence of collectives (the forward's all-reduces, then the logits' all-gather when rank 0 forms
logits), so the group stays in lockstep; the logits themselves are rank 0's to sample. A pipeline stage
instead takes the previous stage's output, runs its own layers, and hands the result on: to the next stage,
or, from the last, as logits to rank 0 (pipe_step.py)."""

import logging
import os

import torch

from kvrelay.kernels import AttentionMetadata
from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.activation_peak import free_kv_blocks
from kvrelay.shared.engine.kv_dtype import attach_kv_scales, kv_cache_dtype
from kvrelay.shared.engine.parallel.layout import RankLayout
from kvrelay.shared.engine.parallel.state import ParallelState
from kvrelay.shared.engine.ranks.broadcast import StepReceiver
from kvrelay.shared.engine.ranks.kv_inlet import Inlet
from kvrelay.shared.engine.ranks.kv_moves import export_blocks, import_blocks, stage_layers, total_kv_heads
from kvrelay.shared.engine.ranks.kv_parts import PartSender, rank_part
from kvrelay.shared.engine.ranks.pipe_step import Pending, recv_carried, send_carried, send_logits
from kvrelay.shared.engine.step_inputs import Layout, views
from kvrelay.shared.wire.rank_step import (
    LOGITS_ALL,
    LOGITS_SAMPLED,
    RankAlloc,
    RankKVDrop,
    RankKVExpect,
    RankKVExport,
    RankKVImport,
    RankKVSend,
    RankProfile,
    RankStep,
    RankStop,
    RankSwap,
)

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle rank checks that rank 0 is still there
PARTS_POLL_MS = 5  # how often a rank whose KV parts wait for room on their socket tries again


class ShardRunner:
    def __init__(self, model, config: EngineConfig, state: ParallelState, device: torch.device,
                 layout: RankLayout, kv_scales: list[list[float]] | None = None,
                 parts: PartSender | None = None, inlet: Inlet | None = None) -> None:
        # state: the whole group (a pipeline's send/recv, agreeing on KV blocks); the model holds its own.
        # kv_scales: an fp8 cache's scales, rank 0's table of every layer; this rank's layers take theirs
        self.model, self.config, self.state, self.device, self.layout = model, config, state, device, layout
        self.dtype = kv_cache_dtype(config.cache.kv_cache_dtype, model.compute_dtype)  # the KV's
        attach_kv_scales(model, device, kv_scales)
        self.block_size = config.cache.block_size
        self.kv_cache: torch.Tensor | None = None
        self.host_cache: torch.Tensor | None = None
        self.parts = parts  # this rank's sockets to decode workers: it sends its own part of handed-off KV
        self.inlet = inlet  # a decode group's: this rank's socket for its own share of arriving KV

    def serve(self, receiver: StepReceiver, parent_pid: int) -> None:
        """Run rank 0's messages until it says stop or is gone."""
        while True:
            waiting = self.parts is not None and not self.parts.flush()
            got = receiver.recv(PARTS_POLL_MS if waiting else IDLE_POLL_MS)
            if got is None:
                if os.getppid() != parent_pid:
                    log.error("rank 0 (pid %d) is gone; exiting", parent_pid)
                    return
                continue
            msg, frame = got
            if isinstance(msg, RankStop):
                return
            if isinstance(msg, RankStep) and self.layout.pp > 1:
                # the step's other micro-batches follow at once: this stage takes them all first
                steps = [(msg, frame)]
                while len(steps) < msg.micro_batches:
                    got = receiver.recv(IDLE_POLL_MS)
                    if got is None and os.getppid() != parent_pid:
                        return
                    if got is not None:
                        if not isinstance(got[0], RankStep):
                            raise ValueError(f"{type(got[0]).__name__} arrived within a step's micro-batches")
                        steps.append(got)
                self._stage_steps(steps)
                continue
            self.handle(msg, frame)

    @torch.inference_mode()
    def handle(self, msg, frame: bytes | None) -> None:
        if isinstance(msg, RankStep):
            self._step(msg, frame)
        elif isinstance(msg, RankSwap):
            self._swap(msg)
        elif isinstance(msg, RankKVExport):
            export_blocks(self.state, self.kv_cache, msg.block_ids, total_kv_heads(self.model),
                          stage_layers(self.model))
        elif isinstance(msg, RankKVSend):
            if self.parts is None:  # rank 0 was given links and hands them to every rank: a bug if not
                raise ValueError("RankKVSend to a rank started without links to decode workers")
            self.parts.send(msg, self.kv_cache, rank_part(self.model, self.layout))
        elif isinstance(msg, (RankKVExpect, RankKVDrop)):
            if self.inlet is None:  # rank 0 was given an inlet host and hands it to every rank: a bug if not
                raise ValueError(f"{type(msg).__name__} to a rank started without an inlet")
            if isinstance(msg, RankKVExpect):
                self.inlet.expect(msg, self.kv_cache)
            else:
                self.inlet.drop(msg)
        elif isinstance(msg, RankKVImport):
            import_blocks(self.state, self.kv_cache, msg.block_ids, None, stage_layers(self.model))
        elif isinstance(msg, RankAlloc):
            self.kv_cache = torch.zeros(self._kv_shape(msg.num_blocks), dtype=self.dtype, device=self.device)
            if msg.num_host_blocks:
                self.host_cache = torch.zeros(self._kv_shape(msg.num_host_blocks), dtype=self.dtype,
                                              pin_memory=self.device.type == "cuda")
        elif isinstance(msg, RankProfile):
            m = self.model
            block_bytes = m.kv_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize
            blocks = free_kv_blocks(m, msg.num_tokens, msg.num_rows, self.block_size, self.dtype, self.device,
                                    self.config.cache.gpu_memory_utilization, block_bytes, max_len=msg.max_len)
            self.state.min_int(blocks)

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.model
        return (m.kv_layers, 2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)

    def _swap(self, msg: RankSwap) -> None:
        # the order and the copies of rank 0's ModelRunner._swap, on this rank's heads
        if msg.swap_out:
            dev_ids, host_ids = zip(*msg.swap_out, strict=True)
            self.host_cache[:, :, list(host_ids)] = self.kv_cache[:, :, list(dev_ids)].to("cpu")
        if msg.swap_in:
            host_ids, dev_ids = zip(*msg.swap_in, strict=True)
            self.kv_cache[:, :, list(dev_ids)] = self.host_cache[:, :, list(host_ids)].to(self.device)

    def _inputs(self, msg: RankStep, frame: bytes):
        """(the step's input tensors on this rank's device, its attention metadata, the rows whose ids rank 0
        broadcasts or None), rebuilt from the frame."""
        layout = Layout(tokens=msg.num_tokens, seqs=msg.num_seqs, width=msg.width)
        host = torch.frombuffer(bytearray(frame), dtype=torch.int32)
        if host.numel() != layout.size + msg.num_fed:
            raise ValueError(f"step inputs of {host.numel()} ints where the layout and its fed rows need "
                             f"{layout.size + msg.num_fed}")
        buf = host if self.device.type == "cpu" else host.to(self.device, non_blocking=True)
        t = views(buf, layout, msg.num_tokens, msg.num_seqs, msg.num_sample_rows)
        host_view = views(host, layout, msg.num_tokens, msg.num_seqs, msg.num_sample_rows)
        meta = AttentionMetadata(
            slot_mapping=t.slot_mapping, query_start_loc=t.query_start_loc, seq_lens=t.seq_lens,
            block_tables=t.block_tables, query_start_loc_cpu=host_view.query_start_loc.tolist(),
            seq_lens_cpu=host_view.seq_lens.tolist(), max_query_len=msg.max_query_len,
            max_seq_len=msg.max_seq_len,
        )
        return t, meta, buf[layout.size:].long() if msg.num_fed else None

    def _take_fed(self, t, fed_rows: torch.Tensor | None) -> None:
        """Async scheduling: the fed rows' ids, sampled by rank 0 a step ago, from rank 0's broadcast."""
        if fed_rows is not None:
            ids = torch.empty(fed_rows.numel(), dtype=torch.int32, device=self.device)
            t.input_ids.index_copy_(0, fed_rows, self.state.broadcast_from_driver(ids))

    @torch.inference_mode()
    def _stage_steps(self, steps: list[tuple[RankStep, bytes]]) -> None:
        """A pipeline stage's part of one step, micro-batch by micro-batch (pipe_step.py): every receive
        from the previous stage is posted first, then each micro-batch runs as soon as its input is here."""
        stage, at = self.model.stage, self.layout
        inputs = [self._inputs(msg, frame) for msg, frame in steps]
        for t, _, fed_rows in inputs:  # rank 0 broadcasts them after the step's last message (pipe_driver.py)
            self._take_fed(t, fed_rows)
        incoming = [None if stage.first else recv_carried(self.state, self.model, msg.num_tokens, at.prev_peer, i)
                    for i, (msg, _) in enumerate(steps)]
        outgoing = Pending()
        for i, ((msg, _), (t, meta, _), pending) in enumerate(zip(steps, inputs, incoming, strict=True)):
            carried = None if pending is None else pending.wait()
            out = self.model(t.input_ids, t.positions, self.kv_cache, meta, carried)
            if stage.last:
                send_logits(self.state, self.model, out, t.sample_rows, msg.num_sample_rows, msg.logits,
                            at.rank == at.logits_sender, i)
            else:
                send_carried(self.state, out, at.next_peer, i, outgoing)
        outgoing.wait()

    def _step(self, msg: RankStep, frame: bytes) -> None:
        t, meta, fed_rows = self._inputs(msg, frame)
        self._take_fed(t, fed_rows)
        hidden = self.model(t.input_ids, t.positions, self.kv_cache, meta)
        if msg.logits == LOGITS_ALL:
            self.model.compute_logits(hidden)
        elif msg.logits == LOGITS_SAMPLED:
            rows = hidden if msg.num_sample_rows == msg.num_tokens else hidden.index_select(0, t.sample_rows)
            self.model.compute_logits(rows)
