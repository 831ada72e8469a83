"""The Sentinel-backed deployment files, checked against the code they deploy without a Docker engine or a
cluster (as tests/unit/test_deploy_stack.py checks the plain ones): the compose `sentinel` profile
(deploy/compose/sentinel.yml) and the Kubernetes overlay (deploy/k8s-sentinel/). Every kvrelay process gets a
``redis+sentinel://`` URL that ``--redis-url`` accepts, naming the sentinels that run and the master set they
monitor; the files the servers read are the ones ``kvrelay redis-acl --sentinel`` prints and git ignores;
the shell the Redis containers run parses; the manifests pass the Kubernetes schemas when
``kubernetes-validate`` is installed."""

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import TypeAdapter

from kvrelay.shared.config.declare import RedisUrl
from kvrelay.shared.wire import redis_sentinel
from tests.unit.test_deploy_stack import COMPOSE, KVRELAY_SERVICES, ROOT, _ComposeLoader, expand, flag, of_kind, parse

OVERRIDE = ROOT / "deploy" / "compose" / "sentinel.yml"
OVERLAY = ROOT / "deploy" / "k8s-sentinel"  # beside deploy/k8s: kustomize refuses a base holding its overlay
SENTINELS = {"sentinel-1", "sentinel-2", "sentinel-3"}


def _substituted(text: str) -> str:
    """Compose's ${VAR:?message} with a value of its own (a password of the right shape)."""
    return re.sub(r"\$\{(\w+)(?::\?[^}]*)?\}", lambda m: m.group(1).lower() + "-0123456789abcdef", text)


@pytest.fixture(scope="module")
def override() -> dict:
    return yaml.load(OVERRIDE.read_text(), Loader=_ComposeLoader)


def _monitor(command: str) -> tuple[str, str, int, int]:
    name, host, port, quorum = re.search(r"sentinel monitor (\S+) (\S+) (\d+) (\d+)", command).groups()
    return name, host, int(port), int(quorum)


def test_compose_profile_runs_a_master_a_replica_and_three_sentinels(override):
    base = yaml.load(COMPOSE.read_text(), Loader=_ComposeLoader)
    services = override["services"]
    assert set(services) - set(base["services"]) == {"redis-replica"} | SENTINELS
    for name in {"redis-replica"} | SENTINELS:  # only with --profile sentinel
        assert services[name]["profiles"] == ["sentinel"], name
    replica = services["redis-replica"]["command"]
    assert flag(replica, "--replicaof") == "redis" and replica[replica.index("--replicaof") + 2] == "6379"
    for name in ("redis", "redis-replica"):  # persistent, with the users and the replication login
        command = services[name]["command"]
        assert command[1] == "/run/secrets/redis-replication.conf" and flag(command, "--appendonly") == "yes"
        assert flag(command, "--aclfile") == "/run/secrets/redis-users.acl"
        assert set(services[name]["secrets"]) == {"redis-users.acl", "redis-replication.conf"}
    for name in SENTINELS:
        script = services[name]["command"][2]
        assert _monitor(script) == ("kvrelay", "redis", 6379, 2)
        assert "cat /run/secrets/sentinel-auth.conf" in script and script.index("sentinel monitor") < script.index("cat ")
        assert services[name]["environment"]["SENTINEL_NAME"] == name
        subprocess.run(["sh", "-n", "-c", script.replace("$$", "$")], check=True)
    for secret in ("redis-replication.conf", "sentinel-auth.conf"):
        path = override["secrets"][secret]["file"]
        assert path == f"./deploy/compose/{secret}" and f"/deploy/compose/{secret}" in (ROOT / ".gitignore").read_text()
    text = OVERRIDE.read_text()
    for line in ("kvrelay redis-acl --sentinel kvrelay > deploy/compose/redis-users.acl",
                 "kvrelay redis-acl --sentinel kvrelay --print redis.conf > deploy/compose/redis-replication.conf",
                 "kvrelay redis-acl --sentinel kvrelay --print sentinel.conf > deploy/compose/sentinel-auth.conf"):
        assert line in text


def test_compose_kvrelay_services_reach_the_master_through_the_sentinels(override):
    services = override["services"]
    for name in KVRELAY_SERVICES:
        url = _substituted(services[name]["environment"]["KVRELAY_REDIS_URL"])
        assert TypeAdapter(RedisUrl).validate_python(url) == url
        spec = redis_sentinel.parse(url)
        assert {h for h, _ in spec.sentinels} == SENTINELS and {p for _, p in spec.sentinels} == {26379}
        assert spec.master == "kvrelay" and spec.options["sentinel_password"]
        assert spec.username == ("gateway" if name.startswith("gateway") else "worker")
        assert set(services[name]["depends_on"]) == SENTINELS
        if name.startswith("gateway"):
            args = parse(services[name]["command"])
            assert args.command == "gateway" and args.redis_outage_s > 5  # > down-after-milliseconds


@pytest.fixture(scope="module")
def overlay() -> dict:
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    docs = [d for d in yaml.safe_load_all((OVERLAY / "redis-sentinel.yaml").read_text()) if d]
    return {"kustomization": kustomization, "docs": docs}


def test_k8s_overlay_replaces_the_single_redis(overlay):
    k = overlay["kustomization"]
    assert k["resources"] == ["../k8s", "redis-sentinel.yaml"]
    deleted = [yaml.safe_load(p["patch"]) for p in k["patches"] if "$patch: delete" in p["patch"]]
    k8s = OVERLAY.parent / "k8s"
    base = [d for name in yaml.safe_load((k8s / "kustomization.yaml").read_text())["resources"]
            for d in yaml.safe_load_all((k8s / name).read_text()) if d]
    assert {(d["kind"], d["metadata"]["name"]) for d in deleted} == {("Deployment", "redis"), ("Service", "redis")}
    for d in deleted:  # each names what the base has
        assert any(b["kind"] == d["kind"] and b["metadata"] == {**b["metadata"], **d["metadata"]} for b in base)
    [outage] = [p for p in k["patches"] if p.get("target", {}).get("name") == "gateway"]
    values = [op["value"] for op in yaml.safe_load(outage["patch"])]
    gateway = of_kind(base, "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    env = {**of_kind(base, "ConfigMap")["kvrelay-config"]["data"], "POD_IP": "10.0.0.7"}
    assert values == ["--redis-outage-s", "10"] and parse(expand(gateway + values, env)).redis_outage_s == 10


def test_k8s_statefulsets_services_and_scripts_agree(overlay):
    docs = overlay["docs"]
    sets, services = of_kind(docs, "StatefulSet"), of_kind(docs, "Service")
    assert (sets["redis-data"]["spec"]["replicas"], sets["redis-sentinel"]["spec"]["replicas"]) == (2, 3)
    for s in sets.values():
        labels = s["spec"]["template"]["metadata"]["labels"]
        assert s["spec"]["selector"]["matchLabels"].items() <= labels.items()
        svc = services[s["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"].items() <= labels.items()
        [container] = s["spec"]["template"]["spec"]["containers"]
        assert {p["name"] for p in container["ports"]} == {p["targetPort"] for p in svc["spec"]["ports"]}
    scripts = of_kind(docs, "ConfigMap")["redis-ha-scripts"]["data"]
    for script in scripts.values():
        subprocess.run(["sh", "-n", "-c", script], check=True)
    name, host, port, quorum = _monitor(scripts["sentinel.sh"].replace("$MASTER", "redis-data-0"))
    assert (name, port, quorum) == ("kvrelay", 6379, 2)
    assert "--replicaof" in scripts["redis.sh"] and "--appendonly yes" in scripts["redis.sh"]
    # the Secret the comment creates: keys the pods mount, URLs --redis-url accepts
    text = (OVERLAY / "redis-sentinel.yaml").read_text()
    for key in ("users.acl", "replication.conf", "sentinel-auth.conf", "sentinel-password", "gateway-url", "worker-url"):
        assert f"--from-file={key}=" in text or f"--from-literal={key}=" in text, key
    hosts = re.search(r"^#\s+S=(\S+)", text, re.M).group(1)
    query = re.search(r'^#\s+Q="(\S+)"', text, re.M).group(1).replace("$KVRELAY_SENTINEL_PASSWORD", "pw")
    url = f"redis+sentinel://gateway:pw@{hosts}/{query}"
    assert TypeAdapter(RedisUrl).validate_python(url)
    spec = redis_sentinel.parse(url)
    assert spec.master == name and len(spec.sentinels) == 3
    assert all(urlsplit(f"//{h}").hostname.endswith(".redis-sentinel") for h, _ in spec.sentinels)


def test_k8s_sentinel_manifests_pass_the_kubernetes_schemas(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    for doc in overlay["docs"]:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_kubectl_kustomize_builds_the_overlay_when_available():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: the structure checks above stand in for it")
    built = subprocess.run([kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not {("Deployment", "redis"), ("Service", "redis")} & names
    assert {("StatefulSet", "redis-data"), ("StatefulSet", "redis-sentinel"), ("Deployment", "gateway")} <= names
    gateway = of_kind(docs, "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert gateway[-2:] == ["--redis-outage-s", "10"]


def test_compose_config_with_the_sentinel_profile_when_available(tmp_path):
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` here: the structure checks above stand in for it")
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE), "-f", str(OVERRIDE), "--profile", "sentinel",
                             "config", "-q"], capture_output=True, text=True, cwd=Path(ROOT))
    assert result.returncode == 0, result.stderr
