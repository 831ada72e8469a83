"""sha256 of repository files, hashed once per file version per host.

With ``--verify-checksums`` every worker hashes a model's files before loading it. On one host the prefill
and decode workers load the same files at the same moment (a swap loads the new version on both), and
hashing 15 GiB twice at once took 3.5–5.5 s each on the H200 host, doubling an 8B swap. Here the first
worker to reach a file hashes it under an exclusive lock while the others wait, and the digest is kept
in a stamp keyed by the file's identity (device, inode) and valid while its size, mtime and ctime are
unchanged, as git's index trusts a file's stat data. Any write, truncation, replacement or relink
changes those, and the file is hashed again. Bit rot under unchanged metadata is not re-detected by a
later load; remove the stamps (``$KVRELAY_CACHE/verified``) to force a full pass.
"""

import fcntl
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from kvrelay.shared.config.confined import RepositoryError
from kvrelay.shared.repo.cache_dir import cache_root

RACY_NS = 2_000_000_000


def sha256_file(path: Path, bar: tqdm | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """The file's sha256, from this host's stamp when the file has not changed since it was hashed."""
    st = os.stat(path)
    ident = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    stamps = cache_root() / "verified"
    key = hashlib.sha256(f"{st.st_dev}:{st.st_ino}".encode()).hexdigest()[:32]
    stamp = stamps / f"{key}.json"
    try:
        stamps.mkdir(parents=True, exist_ok=True)
        lock = open(stamps / f"{key}.lock", "a")
    except OSError:  # no writable cache: hash every time, as without stamps
        return sha256_file(path)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a peer hashing the same file: wait for its stamp
        try:
            data = json.loads(stamp.read_text())
            if data["stat"] == ident:
                return data["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        digest = sha256_file(path)
        st = os.stat(path)
        # Unchanged while we read it, and last written long enough ago that a later write cannot share
        # its timestamp (coarse clocks: the "racily clean" case git guards against the same way).
        if [st.st_size, st.st_mtime_ns, st.st_ctime_ns] == ident and time.time_ns() - st.st_mtime_ns > RACY_NS:
            tmp = stamp.with_suffix(f".tmp{os.getpid()}")
            try:
                tmp.write_text(json.dumps({"stat": ident, "sha256": digest}))
                tmp.replace(stamp)
            except OSError:
                pass
        return digest


def verify_parallel(mv, repo) -> None:
    """The manifest's sha256 per file, hashed on several threads (hashlib releases the GIL), once per file
    version on this host (shared/repo/verified_files.py). Each file is hashed at its resolved path inside
    ``repo`` (a ModelRepository): a manifest naming ``../`` or a link out of the repository is refused."""
    files = list(mv.files.items())

    def check(item: tuple[str, str]) -> None:
        fname, digest = item
        path = repo.file(mv, fname)
        if not path.is_file():
            raise RepositoryError(f"{mv.name} v{mv.version}: {fname} is missing")
        if file_digest(path) != digest:
            raise RepositoryError(f"{mv.name} v{mv.version}: {fname} is corrupt (checksum mismatch)")

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        list(pool.map(check, files))
