"""The production path on one machine, for benchmarks: real nginx (deploy/nginx/nginx.conf, only its
upstreams, listen address and file paths rewritten for loopback) in front of two gateways, a prefill
and a decode worker and an embedded Redis, all as separate processes. Then ``kvrelay bench serve``
drives it, while each process's CPU time is sampled: the answer to "where does the time go".

    python -m bench.nginx_stack --request-rate 200 --num-prompts 4000 [--model DIR] [-- engine flags]

Without --model it builds a tiny random Llama with SmolLM2's tokenizer (the engine then costs almost
nothing, so what is measured is the serving path itself).
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).parents[1]
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
TINY_ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--served-model-name", "tiny",
               "--num-gpu-blocks-override", "8192"]


def loopback_nginx_config(gateway_ports: list[int], listen_port: int, workdir: Path) -> str:
    """deploy/nginx/nginx.conf with its marked upstream and listen lines pointed at loopback and its pid,
    logs and temp files in ``workdir``; timeouts, failover and buffering stay as shipped."""
    text = NGINX_CONF.read_text()
    upstream = [line for line in text.splitlines() if line.strip().endswith("# kvrelay:upstream")]
    if not upstream:
        raise ValueError("nginx.conf has no line marked '# kvrelay:upstream'")
    params = re.search(r"server \S+ (.*);", upstream[0]).group(1)
    servers = "\n".join(f"        server 127.0.0.1:{p} {params};" for p in gateway_ports)
    text = text.replace(upstream[0], servers)
    for line in upstream[1:]:
        text = text.replace(line + "\n", "")
    text = re.sub(r"listen 80;\s*# kvrelay:listen", f"listen 127.0.0.1:{listen_port};", text)
    text = text.replace("pid /var/run/nginx.pid;", f"pid {workdir}/nginx.pid;")
    text = text.replace("access_log /dev/stdout kvrelay;", f"access_log {workdir}/access.log kvrelay;")
    temp = "\n".join(f"    {kind}_temp_path {workdir}/{kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return text.replace("http {\n", "http {\n" + temp + "\n", 1)


def nginx_command(binary: str, workdir: Path) -> list[str]:
    return [binary, "-c", str(workdir / "nginx.conf"), "-p", str(workdir), "-e", "stderr", "-g", "daemon off;"]


def tiny_model(out: Path) -> Path:
    """A random 2-layer Llama sized to SmolLM2's tokenizer, whose files are copied beside it."""
    import torch
    from kvrelay.shared.repo.model_source import resolve_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (out / "config.json").is_file():
        return out
    smollm2 = Path(resolve_model("smollm2").path)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    for f in smollm2.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


@contextlib.contextmanager
def stack(model: str, engine: list[str], log_dir: Path):
    """Yields (nginx base URL, {name: Popen}, {worker role: metrics port}) with everything up and ready;
    stops it all afterwards."""
    from kvrelay.shared.wire.redis_conn import EmbeddedRedis

    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    procs: dict[str, subprocess.Popen] = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")

    def spawn(name: str, argv: list[str]) -> None:
        procs[name] = subprocess.Popen(argv, stdout=open(log_dir / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                                       env=env)

    with EmbeddedRedis() as redis_url:
        cli = [sys.executable, "-m", "kvrelay.cli", "--log-level", "WARNING"]
        ports = [_free_port(), _free_port()]
        try:
            for i, port in enumerate(ports):
                spawn(f"gateway{i + 1}", cli + ["gateway", "--port", str(port), "--redis-url", redis_url])
            metrics = {}
            for role in ("prefill", "decode"):
                metrics[role] = _free_port()
                spawn(role, cli + [f"{role}-worker", "--model", model, "--redis-url", redis_url, "--monitoring-port",
                                   str(metrics[role]), *engine])
            listen = _free_port()
            workdir = log_dir / "nginx"
            workdir.mkdir(mode=0o777, exist_ok=True)
            os.chmod(workdir, 0o777)  # nginx workers run as nobody under a root master
            (workdir / "nginx.conf").write_text(loopback_nginx_config(ports, listen, workdir))
            procs["nginx"] = subprocess.Popen(nginx_command(nginx, workdir), stdout=open(log_dir / "nginx.log", "wb"),
                                              stderr=subprocess.STDOUT)
            for port in ports:
                _wait(f"http://127.0.0.1:{port}/ready")
            _wait(f"http://127.0.0.1:{listen}/nginx-health")
            procs["redis"] = _redis_process(redis_url)
            yield f"http://127.0.0.1:{listen}/v1", procs, metrics
        finally:
            for name, proc in procs.items():
                if name != "redis" and proc.poll() is None:
                    proc.send_signal(signal.SIGQUIT if name == "nginx" else signal.SIGTERM)
            for name, proc in procs.items():
                if name != "redis":
                    try:
                        proc.wait(20)
                    except subprocess.TimeoutExpired:
                        proc.kill()


class _Pid:
    """psutil.Process-like stand-in naming an existing process, for the CPU sampling."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return None


def _redis_process(redis_url: str) -> _Pid:
    import psutil

    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    for proc in psutil.process_iter(["name", "cmdline"]):
        if "redis-server" in (proc.info["name"] or "") and port in " ".join(proc.info["cmdline"] or []):
            return _Pid(proc.pid)
    raise RuntimeError("embedded redis-server not found")


# Worker histograms whose means say where a request's time goes between the gateway and the client.
STAGES = {
    "queue (arrival -> prefill scheduled)": ("prefill", "vllm:request_queue_time_seconds"),
    "TTFT at the prefill worker": ("prefill", "vllm:time_to_first_token_seconds"),
    "KV handoff (first token -> decode ack)": ("prefill", "kvrelay_handoff_seconds"),
    "inter-token latency at the decode worker": ("decode", "vllm:inter_token_latency_seconds"),
    "end to end at the decode worker": ("decode", "vllm:e2e_request_latency_seconds"),
}


def stage_means(metrics: dict[str, int]) -> dict[str, float]:
    """Mean of each STAGES histogram (sum/count over the whole run), in milliseconds."""
    out = {}
    for stage, (role, name) in STAGES.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics[role]}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total = {kind: sum(float(v) for v in re.findall(rf"^{re.escape(name)}_{kind}(?:{{[^}}]*}})? (\S+)$", text, re.M))
                 for kind in ("sum", "count")}
        out[stage] = 1000 * total["sum"] / total["count"] if total["count"] else float("nan")
    return out


def cpu_seconds(procs: dict) -> dict[str, float]:
    """User+system CPU seconds of each process and its children (nginx's workers)."""
    import psutil

    out = {}
    for name, proc in procs.items():
        try:
            p = psutil.Process(proc.pid)
            total = sum(sum(x.cpu_times()[:2]) for x in [p, *p.children(recursive=True)])
        except psutil.NoSuchProcess:
            total = 0.0
        out[name] = total
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model for the workers (default: a tiny random Llama)")
    parser.add_argument("--request-rate", type=float, default=200.0)
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--save-result", default=None, help="bench serve's JSON, plus the CPU breakdown")
    parser.add_argument("engine_args", nargs="*", help="after --: engine flags for both workers")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="kvrelay-nginx-bench-"))
    model = args.model or str(tiny_model(log_dir / "tiny"))
    engine = args.engine_args or TINY_ENGINE
    result = Path(args.save_result or log_dir / "result.json")
    with stack(model, engine, log_dir) as (base_url, procs, metrics):
        from kvrelay.cli import main as kvrelay

        before, started = cpu_seconds(procs), time.monotonic()
        bench = ["--log-level", "WARNING", "bench", "serve", "--base-url", base_url, "--request-rate",
                 str(args.request_rate), "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--ignore-eos", "--save-result", str(result)]
        if args.max_concurrency:
            bench += ["--max-concurrency", str(args.max_concurrency)]
        code = kvrelay(bench)
        wall = time.monotonic() - started
        after = cpu_seconds(procs)
        stages = stage_means(metrics)
    cpu = {name: after[name] - before[name] for name in before}
    print(f"\nCPU seconds over {wall:.1f} s of wall time ({os.cpu_count()} cores; the load generator is this "
          f"process, {time.process_time():.1f} s in total):")
    for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"  {name:10s} {seconds:7.1f} s  {100 * seconds / wall:5.1f}% of one core  "
              f"{1000 * seconds / args.num_prompts:6.2f} ms/request")
    print("Where a request's time goes (worker histograms, mean):")
    for stage, ms in stages.items():
        print(f"  {stage:42s} {ms:8.1f} ms")
    doc = json.loads(result.read_text()) if result.is_file() else {}
    doc["cpu_seconds"], doc["wall_seconds"], doc["stage_means_ms"] = cpu, wall, stages
    result.write_text(json.dumps(doc))
    print(f"logs and results in {log_dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
