"""The per-host record of shared model weights: for each (model files, version, device, dtype) which
process exported them, where (a segment file name, or CUDA IPC fields) and which processes map them.

One JSON file in the shared-weights directory, read and rewritten only under an exclusive ``flock`` on a
lock file beside it, so "look up, else become the exporter" is one atomic step across processes. It
lives on the host, not in Redis: what it describes (files in /dev/shm, handles of one GPU) only exists on
this host, and liveness is the kernel's word: a process is a (pid, start time) pair read from
/proc/<pid>/stat, so a recycled pid is never taken for the process that died.

Every locked access first drops what dead processes held (``prune``): a dead user leaves the users; an
entry whose export never finished and whose exporter died is dropped; on CUDA an entry whose exporter
died is dropped (IPC memory dies with it); an entry nobody alive uses is dropped, and its segment file
unlinked. So the last user's release, or any later access after a crash, frees a model's memory.
"""

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

REGISTRY = "registry.json"
LOCK = "registry.lock"


def default_dir() -> Path:
    """The host-wide shared-weights folder (``--share-weights-dir``'s default): in /dev/shm, where CPU arenas
    are memory, not disk."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"kvrelay-weights-{os.getuid()}"


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/<pid>/stat); 0 where /proc is not readable

    @classmethod
    def me(cls) -> "Proc":
        return cls(os.getpid(), process_start(os.getpid()))

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's live process
        start = process_start(self.pid)
        return start == self.start or 0 in (start, self.start)


def process_start(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # the command name (field 2) may hold spaces and parentheses: count fields after its closing one
    fields = stat[stat.rindex(")") + 2:].split()
    try:
        if fields[0] == "Z":
            return -1  # a zombie has exited: it holds no memory of ours any more
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


@dataclass
class Entry:
    key: str
    model: str  # instance key, for people reading the file
    device: str  # "cpu" or "cuda:<GPU UUID>"
    kind: str  # "cpu" (segment file) | "cuda" (IPC fields)
    nbytes: int
    digest: str  # of the arena layout (shared/engine/weight_arena.py)
    exporter: Proc
    users: list[Proc] = field(default_factory=list)
    ready: bool = False
    segment: str = ""  # cpu: file name inside the shared-weights directory
    ipc: dict = field(default_factory=dict)  # cuda: torch's _share_cuda_ fields, bytes as hex

    @classmethod
    def from_json(cls, d: dict) -> "Entry":
        return cls(**{**d, "exporter": Proc(**d["exporter"]), "users": [Proc(**u) for u in d["users"]]})


class WeightRegistry:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Entry]]:
        """The entries, pruned of the dead, to read and change; written back when the block ends."""
        with open(self.dir / LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entries = self._read()
                self.prune(entries)
                yield entries
                self._write(entries)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def snapshot(self) -> dict[str, Entry]:
        with self.locked() as entries:
            return dict(entries)

    def prune(self, entries: dict[str, Entry]) -> None:
        for key, e in list(entries.items()):
            e.users = [u for u in e.users if u.alive()]
            exporter_alive = e.exporter.alive()
            if (not e.users or (not e.ready and not exporter_alive)
                    or (e.kind == "cuda" and not exporter_alive)):
                del entries[key]
                self.unlink_segment(e)

    def unlink_segment(self, e: Entry) -> None:
        if e.segment:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / e.segment).unlink()

    def _read(self) -> dict[str, Entry]:
        try:
            raw = json.loads((self.dir / REGISTRY).read_text())
            return {k: Entry.from_json(v) for k, v in raw.items()}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, KeyError, AttributeError):
            # written by rename only, so never torn: unreadable means another program's (or version's)
            # file; starting afresh leaves its segments to orphan_segments once their creators are gone
            return {}

    def _write(self, entries: dict[str, Entry]) -> None:
        tmp = self.dir / f".{REGISTRY}.{os.getpid()}"
        tmp.write_text(json.dumps({k: asdict(e) for k, e in entries.items()}))
        tmp.replace(self.dir / REGISTRY)

    def orphan_segments(self) -> list[Path]:
        """Segment files no entry names (left by a crash between creating and registering one)."""
        with self.locked() as entries:
            named = {e.segment for e in entries.values()}
            return [p for p in self.dir.glob("seg-*") if p.name not in named and not _owner_alive(p.name)]


def _owner_alive(name: str) -> bool:
    """A segment is named seg-<pid>-<start>-<n>: its creator may still be filling it."""
    try:
        _, pid, start, _ = name.split("-", 3)
        return Proc(int(pid), int(start)).alive()
    except ValueError:
        return False
