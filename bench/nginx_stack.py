"""The production path on one machine, for benchmarks: real nginx (deploy/nginx/nginx.conf, only its
upstreams, listen address and file paths rewritten for loopback) in front of two gateways, a prefill
and a decode worker and an embedded Redis, all as separate processes. Then ``kvrelay bench serve``
drives it, while each process's CPU time is sampled: the answer to "where does the time go".

    python -m kvrelay.bench.nginx_stack --request-rate 200 --num-prompts 4000 [--model DIR] [-- engine flags]

Without --model it builds a tiny random Llama with SmolLM2's tokenizer (the engine then costs almost
nothing, so what is measured is the serving path itself).
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvrelay.local_cluster import LocalCluster, free_port
from kvrelay.nginx import loopback_nginx

TINY_ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--served-model-name", "tiny",
               "--num-gpu-blocks-override", "8192"]


def tiny_model(out: Path) -> Path:
    """A random 2-layer Llama sized to SmolLM2's tokenizer, whose files are copied beside it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvrelay.shared.repo.model_source import resolve_model

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
    """Yields (nginx base URL, {name: process}, {worker role: metrics port}) with everything up and ready;
    stops it all afterwards."""
    from kvrelay.shared.wire.redis_conn import EmbeddedRedis

    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    with EmbeddedRedis() as redis_url:
        cluster = LocalCluster(redis_url, log_dir, cli_flags=["--log-level", "WARNING"])
        try:
            ports = [cluster.start_gateway(f"gateway{i}") for i in (1, 2)]
            metrics = {}
            for role in ("prefill", "decode"):
                metrics[role] = free_port()
                cluster.start_worker(role, role, model, [*engine, "--monitoring-port", str(metrics[role])])
            listen = free_port()
            with loopback_nginx(nginx, ports, listen, log_dir / "nginx", log_dir / "nginx.log") as proc:
                cluster.wait_ready()
                _wait(f"http://127.0.0.1:{listen}/nginx-health")
                procs = {**cluster.procs, "nginx": proc, "redis": _redis_process(redis_url)}
                yield f"http://127.0.0.1:{listen}/v1", procs, metrics
        finally:
            cluster.stop()


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
