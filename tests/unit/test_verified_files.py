"""Repository files are hashed once per file version on a host, and again whenever they change."""

import hashlib
import os
import threading
import time

import pytest

import kvrelay.shared.repo.verified_files as vf


@pytest.fixture()
def hashes(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    calls = []

    def counting(path, bar=None):
        calls.append(path)
        time.sleep(0.05)  # long enough for a concurrent caller to arrive while we hash
        return hashlib.sha256(path.read_bytes()).hexdigest()

    monkeypatch.setattr(vf, "sha256_file", counting)
    return calls


def aged(path, seconds: float) -> None:
    t = time.time_ns() - int(seconds * 1e9)
    os.utime(path, ns=(t, t))


def test_an_unchanged_file_is_hashed_once(tmp_path, hashes):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    aged(f, 10)
    want = hashlib.sha256(b"a" * 1000).hexdigest()
    assert vf.file_digest(f) == want and vf.file_digest(f) == want
    assert len(hashes) == 1


def test_a_rewritten_file_is_hashed_again(tmp_path, hashes):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    aged(f, 10)
    vf.file_digest(f)
    f.write_bytes(b"b" * 1000)  # same size, new bytes
    aged(f, 5)
    assert vf.file_digest(f) == hashlib.sha256(b"b" * 1000).hexdigest()
    assert len(hashes) == 2


def test_a_just_written_file_gets_no_stamp(tmp_path, hashes):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)  # a write in the same clock tick could not be told apart later
    vf.file_digest(f)
    vf.file_digest(f)
    assert len(hashes) == 2


def test_concurrent_callers_share_one_hash(tmp_path, hashes):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"c" * 4096)
    aged(f, 10)
    out = []
    threads = [threading.Thread(target=lambda: out.append(vf.file_digest(f))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(set(out)) == 1 and len(out) == 4
    assert len(hashes) == 1


def test_no_writable_cache_still_hashes(tmp_path, hashes, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("KVRELAY_CACHE", str(blocker))
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"d" * 10)
    aged(f, 10)
    assert vf.file_digest(f) == hashlib.sha256(b"d" * 10).hexdigest()
