"""The deployment files checked against the code they deploy, without a Docker engine or a cluster:
docker-compose.yml (services, images and build contexts, mounted files, commands parsed by the real
``kvrelay`` CLI parser, advertised addresses, ports Prometheus scrapes, depends_on/healthchecks, GPU
reservations), deploy/docker/Dockerfile, deploy/nginx/nginx.conf's limits against the gateway's, and
deploy/k8s/ (selectors against labels, probes against ports and routes, Services against container
ports, HPAs against Deployments and adapter rules), plus the Kubernetes OpenAPI schemas through the
``kubernetes-validate`` package when it is installed (kubeconform has no PyPI/Debian/npm package)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvrelay.cli import build_parser
from kvrelay.gateway.routes import ROUTES
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.wire.redis_acl import ROLE_OF_COMMAND

ROOT = Path(__file__).parents[2]
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
KVRELAY_SERVICES = {"gateway", "gateway-2", "prefill-worker", "decode-worker"}


class _ComposeLoader(yaml.SafeLoader):
    """Compose's `!reset` tag (deploy/compose/cpu.yml) as plain YAML."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.load(COMPOSE.read_text(), Loader=_ComposeLoader)


def parse(argv: list[str]):
    """The command through the real CLI parser: unknown flags or bad values raise SystemExit."""
    return build_parser().parse_args(argv)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_compose_has_every_role_and_the_monitoring_stack(compose):
    assert set(compose["services"]) == KVRELAY_SERVICES | {"redis", "nginx", "prometheus", "grafana"}


def test_compose_kvrelay_services_build_one_image_and_parse_as_cli_commands(compose):
    roles = {}
    for name in KVRELAY_SERVICES:
        svc = compose["services"][name]
        assert svc["image"] == "kvrelay:latest"
        build = svc["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        args = parse(svc["command"])
        roles[name] = args.command
        assert "--redis-url" not in svc["command"]  # argv is readable by every local user: the URL is in env
        user = "gateway" if args.command == "gateway" else "worker"
        password = f"${{KVRELAY_REDIS_{user.upper()}_PASSWORD:?see the top of docker-compose.yml}}"
        assert svc["environment"]["KVRELAY_REDIS_URL"] == f"redis://{user}:{password}@redis:6379/0"
        assert int(re.search(r"(\d+)s$", svc["stop_grace_period"]).group(1)) > args.drain_timeout
    assert roles == {"gateway": "gateway", "gateway-2": "gateway", "prefill-worker": "prefill-worker",
                     "decode-worker": "decode-worker"}


def test_compose_containers_advertise_addresses_peers_can_dial(compose):
    for name in KVRELAY_SERVICES:
        args = parse(compose["services"][name]["command"])
        if args.command == "gateway":
            # token events come from worker containers: a wildcard bind advertised under the service name
            assert (args.zmq_host, args.zmq_advertise_host, args.host) == ("0.0.0.0", name, "0.0.0.0")
            assert args.max_body_size == GatewayConfig().max_body_size
        else:  # only a decode worker is dialled (prefill workers dial it): the others advertise nothing
            assert (args.host, args.advertise_host) == ("0.0.0.0", name if args.command == "decode-worker" else None)


def test_compose_workers_reserve_a_gpu_and_the_cpu_override_drops_it(compose):
    for name in ("prefill-worker", "decode-worker"):
        [device] = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    override = yaml.load((ROOT / "deploy" / "compose" / "cpu.yml").read_text(), Loader=_ComposeLoader)
    assert set(override["services"]) == {"prefill-worker", "decode-worker"}


def test_compose_mounted_files_exist(compose):
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"


def test_redis_takes_its_users_from_the_aclfile_kvrelay_redis_acl_writes(compose, k8s):
    redis = compose["services"]["redis"]
    assert flag(redis["command"], "--aclfile") == "/run/secrets/redis-users.acl"
    assert redis["secrets"] == ["redis-users.acl"]
    assert compose["secrets"]["redis-users.acl"]["file"] == "./deploy/compose/redis-users.acl"
    assert "/deploy/compose/redis-users.acl" in (ROOT / ".gitignore").read_text().splitlines()
    assert "kvrelay redis-acl > deploy/compose/redis-users.acl" in COMPOSE.read_text()
    [container] = of_kind(k8s, "Deployment")["redis"]["spec"]["template"]["spec"]["containers"]
    assert flag(container["args"], "--aclfile") == "/etc/redis/users.acl"
    assert "kvrelay redis-acl" in (K8S / "redis.yaml").read_text()


def test_compose_dependencies_wait_on_healthchecks(compose):
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        for dep, cond in (deps.items() if isinstance(deps, dict) else ()):
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"
    for name in KVRELAY_SERVICES | {"redis", "nginx"}:
        assert "healthcheck" in services[name], name
    # the worker healthchecks probe the port each worker serves metrics on
    for name in ("prefill-worker", "decode-worker"):
        svc = services[name]
        port = flag(svc["command"], "--monitoring-port")
        assert f"127.0.0.1:{port}/metrics" in " ".join(svc["healthcheck"]["test"])


def test_prometheus_scrapes_what_compose_runs(compose):
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    targets += yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus-targets" / "gateway-2.yml").read_text())[0][
        "targets"]
    for target in targets:
        host, port = target.rsplit(":", 1)
        if host in ("localhost", "alertmanager"):
            continue
        argv = compose["services"][host]["command"]
        serves = flag(argv, "--port") if parse(argv).command == "gateway" else flag(argv, "--monitoring-port")
        assert serves == port, target


def test_nginx_upstream_limits_and_streaming_match_the_gateway(compose):
    conf = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    servers = re.findall(r"server (\S+):(\d+) max_fails=\d+ fail_timeout=\d+s;", conf)
    assert {h for h, _ in servers} == {"gateway", "gateway-2"}
    for host, port in servers:
        assert flag(compose["services"][host]["command"], "--port") == port
    assert "least_conn;" in conf and "proxy_buffering off;" in conf and "proxy_http_version 1.1;" in conf
    assert "proxy_next_upstream error timeout http_502 http_503;" in conf
    assert not re.search(r"^\s*proxy_next_upstream[^;]*non_idempotent", conf, re.M)  # POSTs are never replayed
    body = re.search(r"client_max_body_size (\d+)m;", conf)
    assert int(body.group(1)) * 1024 * 1024 == GatewayConfig().max_body_size
    read_timeout = int(re.search(r"proxy_read_timeout (\d+)s;", conf).group(1))
    assert read_timeout > GatewayConfig().request_timeout  # the gateway's own 504 comes first
    assert "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in compose["services"]["nginx"]["volumes"]


def test_dockerfile_picks_base_and_torch_by_build_args_and_runs_the_cli():
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M) and "FROM ${BASE_IMAGE}" in text
    assert re.search(r"^ARG TORCH_INDEX_URL=", text, re.M)
    assert 'ENTRYPOINT ["kvrelay"]' in text
    for source in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / source).exists(), source
    assert build_parser().parse_args(["serve", "--host", "0.0.0.0"]).command == "serve"  # the default CMD


# -- Kubernetes --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    return [doc for name in listed for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]


def test_k8s_deployments_select_their_pods_and_roll_safely(k8s):
    config = of_kind(k8s, "ConfigMap")["kvrelay-config"]["data"]
    env = {**config, "POD_IP": "10.0.0.7", "POD_NAME": "pod-0"}
    deployments = of_kind(k8s, "Deployment")
    assert set(deployments) == {"redis", "gateway", "prefill-worker", "decode-worker"}
    for name, dep in deployments.items():
        selector = dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
        if name == "redis":
            continue
        rolling = dep["spec"]["strategy"]["rollingUpdate"]
        assert dep["spec"]["strategy"]["type"] == "RollingUpdate" and rolling["maxUnavailable"] == 0
        [container] = dep["spec"]["template"]["spec"]["containers"]
        args = parse(expand(container["args"], env))
        assert args.command == name and "--redis-url" not in container["args"]
        url = next(e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "KVRELAY_REDIS_URL")
        assert url == {"name": "kvrelay-redis", "key": f"{ROLE_OF_COMMAND[name]}-url"}
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > args.drain_timeout + 5  # preStop sleep + drain fit in the grace period
        env_names = {e["name"] for e in container.get("env", [])}
        assert ("POD_IP" in env_names) == (name != "prefill-worker")  # advertised addresses are the pod's own
        if name == "gateway":
            assert args.zmq_advertise_host == "10.0.0.7" and args.zmq_host == "0.0.0.0"
        else:  # a prefill worker dials decode workers and advertises nothing
            assert args.advertise_host == ("10.0.0.7" if name == "decode-worker" else None) and args.host == "0.0.0.0"
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_k8s_probes_hit_real_routes_and_ports(k8s):
    config = of_kind(k8s, "ConfigMap")["kvrelay-config"]["data"]
    env = {**config, "POD_IP": "10.0.0.7", "POD_NAME": "pod-0"}
    routes = {r.path for r in ROUTES if r.method == "GET"}
    for name, dep in of_kind(k8s, "Deployment").items():
        if name == "redis":
            continue
        [container] = dep["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        args = parse(expand(container["args"], env))
        probes = {k: container[k]["httpGet"] for k in ("readinessProbe", "livenessProbe")}
        if name == "gateway":
            assert probes["readinessProbe"]["path"] == "/ready" and probes["livenessProbe"]["path"] == "/health"
            assert {"/ready", "/health"} <= routes
            assert ports[probes["readinessProbe"]["port"]] == args.port
        else:
            # workers: their metrics server, up once the model is loaded and the worker registered
            for probe in probes.values():
                assert ports[probe["port"]] == args.monitoring_port
            assert ports[container["startupProbe"]["httpGet"]["port"]] == args.monitoring_port


def test_k8s_services_and_budgets_match_pods(k8s):
    pods = {n: d["spec"]["template"] for n, d in of_kind(k8s, "Deployment").items()}

    def selected(selector: dict) -> list[str]:
        return [n for n, t in pods.items() if selector.items() <= t["metadata"]["labels"].items()]

    for name, svc in of_kind(k8s, "Service").items():
        [target] = selected(svc["spec"]["selector"])
        [container] = pods[target]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (name, port)
    for name, pdb in of_kind(k8s, "PodDisruptionBudget").items():
        assert selected(pdb["spec"]["selector"]["matchLabels"]) == [name]


def test_k8s_hpas_target_deployments_with_adapter_metrics(k8s):
    deployments = of_kind(k8s, "Deployment")
    rules = yaml.safe_load(of_kind(k8s, "ConfigMap")["kvrelay-adapter-rules"]["data"]["config.yaml"])["rules"]
    exported = {r["name"]["as"] for r in rules}
    hpas = of_kind(k8s, "HorizontalPodAutoscaler")
    assert set(hpas) == {"gateway", "prefill-worker", "decode-worker"}
    for name, hpa in hpas.items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] == name and name in deployments
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 30
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in exported


def test_k8s_metric_names_in_adapter_rules_are_the_ones_the_code_exports():
    rules = (K8S / "prometheus-adapter-rules.yaml").read_text()
    sources = (ROOT / "gateway" / "metrics.py").read_text() + (ROOT / "shared" / "worker" / "metrics.py").read_text()
    for series in ("kvrelay_http_requests", "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert series in rules and f'"{series}"' in sources, series


def test_k8s_manifests_pass_the_kubernetes_schemas(k8s):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    for doc in k8s:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    broken = yaml.safe_load((K8S / "gateway.yaml").read_text().split("---")[0])
    broken["spec"]["replicaz"] = 2
    with pytest.raises(Exception):  # noqa: B017 (the validator's own error types vary by version)
        kubernetes_validate.validate(broken, "1.30.0", strict=True)


def test_compose_config_with_docker_compose_when_available():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` here: the structure checks above stand in for it")
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
