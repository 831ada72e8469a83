"""One step's integer inputs on the host, and how they reach the device in a single copy.

Every integer a forward pass needs (token ids, positions, KV slots, query starts, sequence lengths,
the rows to sample, block tables) lives in one flat int32 buffer whose regions a ``Layout`` names.
The host fills a pinned buffer of that layout and issues one non-blocking copy, so building a step
never waits on the device: the only host sync of a step is reading the sampled ids back. The same
layout, sized to capacity instead of to the step, is the static input buffer of the decode CUDA
graphs (shared/engine/cuda_graphs.py), which is why padding rows are written here too.

int32 everywhere: slots, positions and ids all fit (a slot index below 2**31 is ~2G cached tokens),
and the kernels and torch indexing accept int32 indices.

Every region starts on a 16-byte boundary. Triton specialises a kernel on whether each pointer argument
is 16-byte aligned, so with packed regions the alignment of ``positions`` or ``seq_lens`` followed the
step's token and sequence counts mod 4, and a step of new counts could compile a new variant while
serving; aligned, the variants depend only on the counts' own classes (1, multiple of 16, other), which
warm-up (shared/engine/warmup.py) runs once each.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.kernels import AttentionMetadata


@dataclass
class StepBatch:
    """The flat batch of one step, on the host. Sequence i owns token rows
    ``query_start_loc[i]:query_start_loc[i+1]``."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    query_start_loc: list[int]  # [S + 1]
    seq_lens: list[int]  # [S] KV length after this step
    block_tables: list[np.ndarray]  # S rows of int32 block ids, ragged
    sample_rows: list[int]  # [R] flat row of the last token of each request that samples

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        qsl = self.query_start_loc
        return max(b - a for a, b in zip(qsl, qsl[1:], strict=False))

    @property
    def samples_every_row(self) -> bool:
        """Each token row is a sampled row, in order (the usual decode step): no gather needed."""
        return len(self.sample_rows) == self.num_tokens


ALIGN = 4  # int32s: 16 bytes, Triton's pointer-alignment specialisation


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    """Region offsets in one flat int32 buffer; capacities, not contents (a step may use less)."""

    tokens: int
    seqs: int
    width: int  # block-table columns

    @property
    def ids(self) -> int:
        return 0

    @property
    def positions(self) -> int:
        return _aligned(self.tokens)

    @property
    def slots(self) -> int:
        return 2 * _aligned(self.tokens)

    @property
    def query_start_loc(self) -> int:
        return 3 * _aligned(self.tokens)

    @property
    def seq_lens(self) -> int:
        return self.query_start_loc + _aligned(self.seqs + 1)

    @property
    def sample_rows(self) -> int:
        return self.seq_lens + _aligned(self.seqs)

    @property
    def tables(self) -> int:
        return self.sample_rows + _aligned(self.tokens)

    def size_through_row(self, rows: int) -> int:
        """Length of the prefix that holds every region plus the first ``rows`` block-table rows."""
        return self.tables + rows * self.width

    @property
    def size(self) -> int:
        return self.size_through_row(self.seqs)


@dataclass
class StepTensors:
    """Device views into one packed buffer; dtypes int32."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T], -1 on padding rows (write_kv skips them)
    query_start_loc: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S]
    sample_rows: torch.Tensor  # [R]
    block_tables: torch.Tensor  # [S, width]


def write(buf: np.ndarray, layout: Layout, batch: StepBatch, padded_seqs: int | None = None) -> None:
    """Fill ``buf`` (int32, at least ``layout.size_through_row(rows)`` long) from ``batch``.

    ``padded_seqs``: pad a decode batch (one token per sequence) up to this many rows. A padding row
    reads token 0 at position 0, writes no KV (slot -1) and attends to one token of block 0, so it
    computes finite garbage that nobody reads, and touches nothing a real row owns.
    """
    rows = batch.num_seqs if padded_seqs is None else padded_seqs
    n_tok, n_seq = batch.num_tokens, batch.num_seqs
    if padded_seqs is not None and n_tok != n_seq:
        raise ValueError("only decode batches (one token per sequence) are padded")
    need_tokens = max(n_tok, rows, len(batch.sample_rows))
    if rows > layout.seqs or need_tokens > layout.tokens:
        raise ValueError(f"batch of {n_seq} sequences / {n_tok} tokens exceeds the layout {layout}")
    pad = rows - n_seq
    o = layout
    buf[o.ids:o.ids + n_tok] = batch.input_ids
    buf[o.positions:o.positions + n_tok] = batch.positions
    buf[o.slots:o.slots + n_tok] = batch.slot_mapping
    buf[o.query_start_loc:o.query_start_loc + n_seq + 1] = batch.query_start_loc
    buf[o.seq_lens:o.seq_lens + n_seq] = batch.seq_lens
    buf[o.sample_rows:o.sample_rows + len(batch.sample_rows)] = batch.sample_rows
    if pad:
        buf[o.ids + n_tok:o.ids + rows] = 0
        buf[o.positions + n_tok:o.positions + rows] = 0
        buf[o.slots + n_tok:o.slots + rows] = -1
        end = batch.query_start_loc[-1]
        buf[o.query_start_loc + n_seq + 1:o.query_start_loc + rows + 1] = np.arange(end + 1, end + pad + 1)
        buf[o.seq_lens + n_seq:o.seq_lens + rows] = 1
    tables = buf[o.tables:o.tables + rows * o.width].reshape(rows, o.width)
    # zeroed first: a kernel that gathers whole rows (the torch reference) must see valid block ids
    tables[:] = 0
    for i, row in enumerate(batch.block_tables):
        tables[i, :row.size] = row


def views(buf: torch.Tensor, layout: Layout, tokens: int, seqs: int, sample_rows: int) -> StepTensors:
    o = layout
    return StepTensors(
        input_ids=buf[o.ids:o.ids + tokens],
        positions=buf[o.positions:o.positions + tokens],
        slot_mapping=buf[o.slots:o.slots + tokens],
        query_start_loc=buf[o.query_start_loc:o.query_start_loc + seqs + 1],
        seq_lens=buf[o.seq_lens:o.seq_lens + seqs],
        sample_rows=buf[o.sample_rows:o.sample_rows + sample_rows],
        block_tables=buf[o.tables:o.tables + seqs * o.width].view(seqs, o.width),
    )


def host_buffer(size: int, device: torch.device) -> torch.Tensor:
    """An int32 host buffer to fill through ``.numpy()``: pinned when it is bound for a GPU.

    Pinned blocks come from torch's caching host allocator, which does not hand a block out again
    until the copy that read it has finished, so no step overwrites a buffer still in flight."""
    return torch.empty(size, dtype=torch.int32, pin_memory=device.type == "cuda")


def to_host(batch: StepBatch, device: torch.device) -> tuple[Layout, torch.Tensor]:
    """An eager step's layout, sized to this batch, and its filled host buffer (bound for ``device``)."""
    # a multiple of 16 columns: the table's row stride is a kernel argument Triton specialises on too
    width = -(-max((t.size for t in batch.block_tables), default=1) // 16) * 16
    layout = Layout(tokens=batch.num_tokens, seqs=batch.num_seqs, width=width)
    host = host_buffer(layout.size, device)
    write(host.numpy(), layout, batch)
    return layout, host


def to_device(batch: StepBatch, device: torch.device,
              filled: tuple[Layout, torch.Tensor] | None = None) -> StepTensors:
    """Eager steps: a layout sized to this batch, filled on the host, one non-blocking copy.
    ``filled``: ``to_host``'s result when the caller needed the host buffer too (tensor parallelism)."""
    layout, host = filled or to_host(batch, device)
    dev = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return views(dev, layout, batch.num_tokens, batch.num_seqs, len(batch.sample_rows))


def device_inputs(batch: StepBatch, device: torch.device, filled: tuple[Layout, torch.Tensor] | None,
                  fill: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[StepTensors, AttentionMetadata]:
    """An eager step's tensors on ``device`` (``to_device``) with the ``fill`` (token rows, ids on the device)
    written into its input ids, and its attention metadata."""
    t = to_device(batch, device, filled)  # on the CPU: views of the frame's buffer, so filled after it
    if fill is not None:
        t.input_ids.index_copy_(0, fill[0], fill[1])
    return t, AttentionMetadata(
        slot_mapping=t.slot_mapping, query_start_loc=t.query_start_loc, seq_lens=t.seq_lens,
        block_tables=t.block_tables, query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens, max_query_len=batch.max_query_len, max_seq_len=max(batch.seq_lens),
    )


def to_device_ints(rows: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """A small int64 table (index tensors) on ``device`` without waiting on it: pinned, non-blocking."""
    host = torch.tensor(rows, dtype=torch.int64)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


class BlockTableCache:
    """Per-request int32 copies of block tables, so a step converts only the blocks that are new.

    The scheduler hands over each table as a fresh Python list every step; converting 128 tables of
    ~130 blocks costs ~0.4 ms a step, the cache ~0.05 ms. A cached row is reused only while the
    request's list still starts with exactly the cached blocks (a preempted request gets new ones)."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[list[int], np.ndarray]] = {}

    def get(self, request_id: str, blocks: list[int]) -> np.ndarray:
        cached = self._rows.get(request_id)
        if cached is not None:
            known, arr = cached
            n = len(known)
            if len(blocks) == n and blocks == known:
                return arr
            if len(blocks) > n and blocks[:n] == known:
                arr = np.concatenate((arr, np.asarray(blocks[n:], dtype=np.int32)))
                self._rows[request_id] = (blocks, arr)
                return arr
        arr = np.asarray(blocks, dtype=np.int32)
        self._rows[request_id] = (blocks, arr)
        return arr

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)
