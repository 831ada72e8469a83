"""``kvrelay bench swap``: how long a version swap takes under load, and what it costs the other models.

One ``kvrelay serve --config`` (embedded Redis, gateway, one worker per role hosting every model) serves
``main`` (versions 1 and 2 in a fresh repository) and ``other``. Closed-loop clients keep both busy; after
``--before`` seconds ``POST /admin/models/main/swap {"version": 2}`` runs while they go on. Printed: the
swap's duration (load of v2 on every role, readiness, the flip, the old version's drain order), the time
until new requests went to v2 (the flip; ``serving_new_version_after_s``), failed
requests (the target is zero), and the latency percentiles of ``other``'s requests before, during and
after the swap, the ratio during/before being what co-residents pay for a hot swap.

Weights: an HF directory, ``smollm2``, or ``dummy:<preset>``, which writes that preset's shapes with random
bf16 weights as sharded safetensors once (cached under ``--work-dir``). Both versions of ``main`` are the
same files hard-linked, so v2 loads from the page cache, as a just-imported version does. Without
``--work-dir`` everything goes to a temporary folder that is removed however the run ends (failure,
Ctrl-C, SIGTERM).
"""

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.repo.model_import import version_manifest
from kvrelay.shared.repo.model_repo import MANIFEST, ModelRepository
from kvrelay.shared.wire.loopback_ports import free_port

ADMIN_KEY = "bench-swap-admin-key-0123456789"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="main's weights: HF dir, smollm2, or dummy:<preset>")
    p.add_argument("--other", default=None, help="the co-resident model (default: the same as --model)")
    p.add_argument("--work-dir", default=None, help="where the repository, generated weights and serve's log go, "
                   "kept (default: a temporary folder, removed however the run ends)")
    p.add_argument("--concurrency", type=int, default=2, help="closed-loop clients per model")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--before", type=float, default=10.0, help="seconds of load before the swap")
    p.add_argument("--after", type=float, default=10.0, help="seconds of load after it")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="every model's context, passed to serve unless given after --: during the swap a worker holds "
                   "three instances (main v1 and v2, other), each reserving one full-length sequence of KV, and at "
                   "SmolLM2's own 8,192 the CPU default pool (1 GiB) holds two")
    p.add_argument("--mode", choices=["disaggregated", "unified"], default="disaggregated")
    p.add_argument("--timeout", type=float, default=600.0, help="startup and swap limit")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: flags for kvrelay serve")


def run(args: argparse.Namespace) -> int:
    if args.input_len + args.output_len > args.max_model_len:
        raise SystemExit(f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds "
                         f"--max-model-len ({args.max_model_len})")
    # a SIGTERM ends the run like Ctrl-C does: through the finally blocks that stop serve and remove the folder
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.work_dir:
        return _run(args, Path(args.work_dir))
    with tempfile.TemporaryDirectory(prefix="kvrelay-swap-") as work:  # removed however the run ends
        return _run(args, Path(work))


def _run(args: argparse.Namespace, work: Path) -> int:
    repo = ModelRepository(work / "repo")
    main_src = materialize(args.model, work)
    other_src = materialize(args.other or args.model, work)
    t0 = time.perf_counter()
    for name, src, versions in (("main", main_src, (1, 2)), ("other", other_src, (1,))):
        for v in versions:
            link_version(repo, src, name, v)
    print(f"repository ready in {time.perf_counter() - t0:.1f}s at {repo.root}", flush=True)
    cfg = work / "swap.yaml"
    cfg.write_text(f"model_repo: {{type: local, path: {repo.root}}}\nmodels:\n"
                   "  - {name: main, version: 1}\n  - {name: other, version: 1}\n")
    port = free_port()
    serve_args = [a for a in args.serve_args if a != "--"]
    if "--max-model-len" not in serve_args:
        serve_args += ["--max-model-len", str(args.max_model_len)]
    log_path = work / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*module_argv("kvrelay.cli"), "--log-level", "INFO", "serve", "--config",
                                 str(cfg), "--port", str(port), "--mode", args.mode, "--state-dir", str(work / "state"),
                                 *serve_args],
                                stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, KVRELAY_ADMIN_KEY=ADMIN_KEY, PYTHONUNBUFFERED="1"))
    try:
        _wait_ready(port, proc, log_path, args.timeout)
        _admin(port, "POST", "/admin/tenants", {"name": "bench"})
        key = _admin(port, "POST", "/admin/keys", {"tenant": "bench"})[1]["key"]
        result = measure(args, port, key)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(json.dumps(result, indent=2))
    if result["failed"] == 0 and result["swap_status"] == 200:
        return 0
    if not args.work_dir:  # the folder goes with the log in it: its end is the failure's story
        print("kvrelay serve's log, last lines:\n" + log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
    return 1


def measure(args: argparse.Namespace, port: int, key: str) -> dict:
    import logging

    import openai

    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)  # one line per request drowns the result

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=args.timeout)
    records: list[tuple[str, float, float, bool]] = []  # (model, start, latency, ok)
    stop = threading.Event()
    prompt = [(7 * i) % 200 + 10 for i in range(args.input_len)]

    def loop(model: str) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                client.completions.create(model=model, prompt=prompt, max_tokens=args.output_len, temperature=0.0,
                                          extra_body={"ignore_eos": True})
                records.append((model, start, time.monotonic() - start, True))
            except Exception as exc:  # every failure counts against the swap
                print(f"{model} request failed: {exc}", flush=True)
                records.append((model, start, time.monotonic() - start, False))

    for model in ("main", "other"):  # first requests compile kernels (Triton JIT): not the swap's cost
        for _ in range(2):
            client.completions.create(model=model, prompt=prompt, max_tokens=args.output_len, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    threads = [threading.Thread(target=loop, args=(m,), daemon=True)
               for m in ("main", "other") for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    time.sleep(args.before)
    swap_start, swap_start_wall = time.monotonic(), time.time()
    status, body = _admin(port, "POST", "/admin/models/main/swap", {"version": 2}, timeout=args.timeout)
    swap_end = time.monotonic()
    time.sleep(args.after)
    stop.set()
    for t in threads:
        t.join(args.timeout)

    def pct(model: str, lo: float, hi: float) -> dict:
        lat = sorted(r[2] for r in records if r[0] == model and r[3] and lo <= r[1] < hi)
        if not lat:
            return {"n": 0}
        return {"n": len(lat), "p50_ms": round(1000 * statistics.median(lat), 1),
                "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1)}

    phases = {"before": (0, swap_start), "during": (swap_start, swap_end), "after": (swap_end, float("inf"))}
    other = {k: pct("other", *v) for k, v in phases.items()}
    main = {k: pct("main", *v) for k, v in phases.items()}
    ratio = None
    if other["during"].get("n") and other["before"].get("n"):
        ratio = round(other["during"]["p99_ms"] / other["before"]["p99_ms"], 2)
    # the registry's "updated" stamp is the flip: from then on new requests go to version 2
    flip = body.get("updated") if isinstance(body, dict) else None
    return {"swap_s": round(swap_end - swap_start, 2), "swap_status": status,
            "serving_new_version_after_s": round(flip - swap_start_wall, 2) if flip else None, "swap_body": body,
            "failed": sum(1 for r in records if not r[3]), "requests": len(records),
            "other_latency": other, "main_latency": main, "other_p99_during_over_before": ratio}


# -- weights and repository -------------------------------------------------------------------------
def materialize(model: str, work: Path) -> Path:
    """A model directory for ``model`` (HF dir, smollm2, dummy:<preset>)."""
    if model.startswith("dummy:"):
        return write_dummy(model.removeprefix("dummy:"), work / "weights" / model.removeprefix("dummy:"))
    from kvrelay.shared.repo.model_source import resolve_model

    return Path(resolve_model(model).path)


def write_dummy(preset: str, out: Path, shard_bytes: int = 4 << 30) -> Path:
    """The preset's HF tensor names and shapes, random bf16 values (std 0.02), in safetensors shards."""
    if (out / "config.json").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvrelay.shared.config.presets import get_preset
    from kvrelay.shared.repo.model_source import dummy_tokenizer_dir

    config = get_preset(preset)
    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(hf).state_dict().items()}
    if getattr(hf, "tie_word_embeddings", False):
        names.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # random values drawn on the GPU when there is one: torch's CPU normal_ in bf16 wrote an 8B model
    # in 262 s on the H200 host, most of a device session; elsewhere one random tile repeated
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(0)
    tile = torch.randn(1 << 20, generator=g, device=device).mul_(0.02).to(torch.bfloat16)
    shard, size, index, n = {}, 0, {}, 0
    t0 = time.perf_counter()

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            n += 1
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, tmp / fname, metadata={"format": "pt"})
            index.update({k: fname for k in shard})
            shard, size = {}, 0

    for name, shape in names.items():
        numel = math.prod(shape)
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif device == "cuda":
            t = torch.randn(shape, generator=g, device=device).mul_(0.02).to(torch.bfloat16).cpu()
        else:
            t = tile.repeat(-(-numel // tile.numel()))[:numel].view(shape).clone()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    hf.torch_dtype = "bfloat16"
    hf.save_pretrained(tmp)
    for f in dummy_tokenizer_dir(preset).iterdir():
        shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    print(f"wrote {preset} weights ({n} shards) in {time.perf_counter() - t0:.1f}s", flush=True)
    return out


def link_version(repo: ModelRepository, src: Path, name: str, version: int) -> None:
    """``src`` as ``name`` v``version``: files hard-linked where the filesystem allows (no second copy of
    the bytes), with a manifest of their checksums like any import."""
    final = repo.root / name / str(version)
    if (final / MANIFEST).is_file():
        return
    staging = repo.root / name / f".linking-{version}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, staging / f.name)
            except OSError:
                shutil.copyfile(f, staging / f.name)
    mv = version_manifest(staging, name, version, str(src), progress=False)
    (staging / MANIFEST).write_text(json.dumps({k: v for k, v in vars(mv).items() if k != "path"}, indent=2))
    staging.rename(final)


# -- plumbing ---------------------------------------------------------------------------------------

def _wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while b"kvrelay ready" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("kvrelay serve did not come up:\n" + log.read_text(errors="replace")[-4000:])
        time.sleep(0.5)


def _admin(port: int, method: str, path: str, body: dict | None = None, timeout: float = 60.0):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
