"""deploy/: the Prometheus config, alert rules, Grafana dashboard and provisioning parse, have the alerts
and panels the operators rely on, and reference only metric names the code defines (worker metrics
through a real WorkerMetrics registry, the gateway's through GatewayMetrics). A vllm:* name both the
gateway and the workers serve is read from one side only, chosen by job, so nothing counts a request
twice. The e2e tenancy test checks the same names against live scrapes. With promtool installed,
``promtool check`` validates the files and ``promtool test rules`` (deploy/prometheus/alerts_test.yml)
shows the alerts fire as meant."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
# Series a worker only has when it computes on a GPU and NVML imports.
NVML_ONLY = {"kvrelay_gpu_utilization_ratio", "kvrelay_gpu_memory_used_bytes", "kvrelay_gpu_memory_total_bytes"}
_OURS = ("vllm:", "kvrelay_", "process_")
GATEWAY_JOB = "kvrelay-gateway"
WORKER_JOBS = {"kvrelay-prefill", "kvrelay-decode", "kvrelay-unified"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def _names_in(expr: str) -> set[str]:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values are not metric names
    return {n for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if n.startswith(_OURS) or n == "up"}


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads((GRAFANA / "dashboard.json").read_text())


def panel_exprs() -> list[str]:
    """The panels' queries, with the job variables at their defaults (an operator whose Prometheus names
    the jobs otherwise sets them in the dashboard)."""
    d = dashboard()
    defaults = {v["name"]: v["query"] for v in d["templating"]["list"] if v["type"] == "textbox"}
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    for name, value in defaults.items():
        exprs = [e.replace(f"${name}", value) for e in exprs]
    return exprs


def dashboard_exprs() -> list[str]:
    """The panels' queries and the template variables' (which only list label values)."""
    return panel_exprs() + [v["definition"] for v in dashboard()["templating"]["list"] if "definition" in v]


def scrape_jobs() -> set[str]:
    cfg = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    return {j["job_name"] for j in cfg["scrape_configs"]}


def selected_jobs(name: str, expr: str, jobs: set[str]) -> list[set[str]]:
    """For each selector of ``name`` in ``expr``, the scrape jobs its ``job`` matcher admits (all of
    them without one)."""
    admitted = []
    for matchers in re.findall(rf"(?<![a-zA-Z0-9_:]){re.escape(name)}(?![a-zA-Z0-9_:])(\{{[^}}]*\}})?", expr):
        job = re.search(r'\bjob\s*(=~|=)\s*"([^"]*)"', matchers)
        if job is None:
            admitted.append(set(jobs))
        elif job.group(1) == "=":
            admitted.append({job.group(2)} & jobs)
        else:
            admitted.append({j for j in jobs if re.fullmatch(job.group(2), j)})
    return admitted


def template_queries(rule: dict) -> list[str]:
    """The PromQL queries a rule's annotations run (``printf "..." | query``), with their Go escapes undone."""
    texts = rule.get("annotations", {}).values()
    return [q.replace('\\"', '"') for t in texts for q in re.findall(r'printf\s+"((?:[^"\\]|\\.)*)"', t)]


def alert_tests() -> dict:
    return yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())


def referenced_metrics() -> set[str]:
    """Every metric name the alert rules (their annotations' queries too), the dashboard and the alerts' promtool
    test query or feed."""
    names: set[str] = set()
    queries = [q for r in alert_rules() for q in [r["expr"], *template_queries(r)]]
    series = [s["series"] for case in alert_tests()["tests"] for s in case["input_series"]]
    for expr in queries + dashboard_exprs() + series:
        names |= _names_in(expr)
    return names


def exposed_names(text: str) -> set[str]:
    """The names a PromQL query can use for what a /metrics page exposes (families with no samples yet
    included: a labelled metric nobody has touched still has its HELP/TYPE lines)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names |= {fam.name + s for s in _SUFFIXES.get(fam.type, ())}
        names |= {s.name for s in fam.samples}
    return names


def worker_names() -> set[str]:
    from kvrelay.shared.worker.host_stats import HostCollector
    from tests.unit.test_worker_metrics import Engine, FakeNvml

    worker = generate_latest(Engine("unified").metrics.registry).decode()
    gpu = {f.name for f in HostCollector(FakeNvml(), [("GPU-0", object())]).collect()}
    return exposed_names(worker) | gpu


def gateway_names() -> set[str] | None:
    """None while the gateway has no metrics module (it is written separately from the workers')."""
    try:
        from kvrelay.gateway.metrics import GatewayMetrics
    except ImportError:
        return None
    return exposed_names(generate_latest(GatewayMetrics().registry).decode())


def check_names(referenced: set[str], worker: set[str], gateway: set[str] | None) -> None:
    """Every referenced name must exist; without the gateway's names, what the workers lack is only
    reported (pytest.skip), and must at least be kvrelay_* (the workers serve every vllm:* name)."""
    unresolved = referenced - worker - {"up"}
    if gateway is None:
        assert all(n.startswith("kvrelay_") for n in unresolved), sorted(unresolved)
        pytest.skip(f"gateway metrics unavailable; unchecked: {sorted(unresolved)}")
    assert not unresolved - gateway, sorted(unresolved - gateway)


def test_alert_rules_parse_and_cover_the_required_conditions():
    rules = {r["alert"]: r for r in alert_rules()}
    for rule in rules.values():
        assert rule["expr"].strip() and rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]
    high = rules["HighLatency"]
    assert "vllm:e2e_request_latency_seconds_bucket" in high["expr"] and "0.99" in high["expr"]
    assert re.search(r">\s*0\.5\b", high["expr"]) and high["for"] == "5m"
    assert "5.." in rules["HighErrorRate"]["expr"] and "0.001" in rules["HighErrorRate"]["expr"]
    assert "< 0.7" in rules["GPUUnderutilized"]["expr"] and "num_requests_running" in rules["GPUUnderutilized"]["expr"]
    assert "kvrelay_queue_depth" in rules["QueueGrowing"]["expr"]
    assert rules["WorkerDown"]["expr"].startswith("up{")
    # one alert per worker stalled for minutes, from the gateways' judgement, not one per gateway scraped
    stalled = rules["WorkerStalled"]
    assert re.fullmatch(r'max by \(role, worker_id\) \(kvrelay_worker_stalled\{job="kvrelay-gateway"\}\) == 1',
                        stalled["expr"].strip()) and re.fullmatch(r"\d+m", stalled["for"]), stalled
    assert template_queries(stalled) == ['max(kvrelay_worker_step_age_seconds{job="kvrelay-gateway", worker_id=%q})']


def test_the_promtool_cases_test_alerts_that_exist():
    """What ``promtool test rules`` checks, as far as it can be without promtool: its cases name rules of
    alerts.yml (a renamed rule would leave its case testing nothing), the stalled-worker alert among them."""
    doc = alert_tests()
    assert doc["rule_files"] == ["alerts.yml"]
    tested = {c["alertname"] for case in doc["tests"] for c in case["alert_rule_test"]}
    assert tested <= {r["alert"] for r in alert_rules()}, tested
    assert {"HighLatency", "HighErrorRate", "WorkerDown", "WorkerStalled"} <= tested


def test_prometheus_scrapes_gateway_and_workers():
    cfg = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert {"kvrelay-gateway", "kvrelay-prefill", "kvrelay-decode", "kvrelay-unified"} <= jobs.keys()
    assert all(j.get("metrics_path", "/metrics") == "/metrics" for j in jobs.values())
    # every job the alerts select by name exists
    for rule in alert_rules():
        for job in re.findall(r'job=~?"([^"]+)"', rule["expr"]):
            assert any(re.fullmatch(job, name) for name in jobs), (rule["alert"], job)


def test_dashboard_and_provisioning():
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"] for p in d["panels"]).lower()
    for needed in ("end-to-end latency", "time to first token", "inter-token latency", "tokens per second",
                   "kv cache", "queue depth", "per tenant", "error", "gpu"):
        assert needed in titles, needed
    for p in d["panels"]:
        if p["type"] != "row":  # every query goes to the data source the viewer picked
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvrelay.yml").read_text())
    assert dash["providers"][0]["options"]["path"]


def test_deploy_references_only_defined_metrics():
    referenced = referenced_metrics()
    assert len(referenced) > 25
    worker = worker_names()
    assert NVML_ONLY <= worker
    check_names(referenced, worker, gateway_names())


def test_series_both_sides_serve_are_read_from_one_side():
    """A vllm:* name the gateway and the workers both serve counts each request once per side: every
    query of one selects the gateway's job or worker jobs only, never both (nor no job at all)."""
    shared = {n for n in gateway_names() & worker_names() if n.startswith("vllm:")}
    assert {"vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total",
            "vllm:num_requests_running"} <= shared
    jobs = scrape_jobs()
    assert GATEWAY_JOB in jobs and WORKER_JOBS <= jobs
    reads: dict[str, set[str]] = {"gateway": set(), "workers": set()}
    for expr in [r["expr"] for r in alert_rules()] + panel_exprs():
        for name in shared:
            for admitted in selected_jobs(name, expr, jobs):
                assert admitted in ({GATEWAY_JOB}, WORKER_JOBS), (name, sorted(admitted), expr)
                reads["gateway" if admitted == {GATEWAY_JOB} else "workers"].add(name)
    # what clients see comes from the gateway; the engine's breakdown from the workers
    assert {"vllm:e2e_request_latency_seconds_bucket", "vllm:time_to_first_token_seconds_bucket",
            "vllm:generation_tokens_total", "vllm:request_success_total"} <= reads["gateway"]
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running"} <= reads["workers"]


def test_job_selection_sees_through_promql():
    jobs = {GATEWAY_JOB, *WORKER_JOBS}
    expr = ('rate(vllm:x_total{job="kvrelay-gateway"}[5m]) / rate(vllm:x_total{model_name="m"}[5m])'
            ' + vllm:x_total_other{job=~"kvrelay-(decode|unified)"} + vllm:x_total{job=~"kvrelay-.*"}')
    assert selected_jobs("vllm:x_total", expr, jobs) == [{GATEWAY_JOB}, jobs, jobs]
    assert selected_jobs("vllm:x_total_other", expr, jobs) == [{"kvrelay-decode", "kvrelay-unified"}]


def test_name_extraction_sees_through_promql():
    expr = 'sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name=~"kvrelay_x"}[5m])) / up'
    assert _names_in(expr) == {"vllm:e2e_request_latency_seconds_bucket", "up"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_rules_and_config_and_alerts_fire_as_specified():
    # alerts_test.yml feeds synthetic series through the rules and lists the alerts that must fire
    for args in (["check", "rules", str(PROMETHEUS / "alerts.yml")],
                 ["check", "config", "--syntax-only", str(PROMETHEUS / "prometheus.yml")],
                 ["test", "rules", str(PROMETHEUS / "alerts_test.yml")]):
        proc = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
