"""Runs one worker process of a given role from its config: built from the command line's flags, or
handed over by ``kvrelay serve`` (shared/config/handover.py)."""

import argparse
import dataclasses
import time
from pathlib import Path

from kvrelay.cli_args import WORKER_FLAGS, engine_config_from_args, worker_values, zmq_secret
from kvrelay.serve_config import ServedModel, load_serve_config
from kvrelay.shared.config import depends
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.engine import NEEDS as ENGINE_NEEDS
from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.config.flags import GIVEN, Flag, build, given
from kvrelay.shared.config.worker import NEEDS as WORKER_NEEDS
from kvrelay.shared.config.worker import StartupModel, WorkerConfig, check_sm_share
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.text.progress import label_process
from kvrelay.shared.wire.protocol import ModelSpec


def run_worker(config: WorkerConfig) -> int:
    label_process(f"{config.role} worker", line=1 if config.role == "decode" else 0)  # kvrelay serve's order
    from kvrelay.shared.worker import gpu_share

    gpu_share.check(config)
    gpu_share.setup(config)
    if config.role == "prefill":
        from kvrelay.prefill_worker.worker import PrefillWorker as cls
    elif config.role == "decode":
        from kvrelay.decode_worker.worker import DecodeWorker as cls
    else:
        from kvrelay.unified_worker.worker import UnifiedWorker as cls
    cls(config).run()
    return 0


def worker_config(role: str, args: argparse.Namespace, flags: list[Flag] = WORKER_FLAGS, *, other_pipeline: int = 1,
                  **derived) -> WorkerConfig:
    """``--model`` (default SmolLM2) is the worker's one model, unless ``--config`` lists its models or
    ``--model-repo`` alone starts it empty, to be loaded through the admin API. ``flags``: the command
    line's names for the worker's settings (kvrelay serve renames some); ``derived``: what the launcher
    decided (kvrelay serve's ZMQ secret). ``other_pipeline``: kvrelay serve's other role's pipeline size, where a
    model of --config of no size of its own has the pipeline its pipeline_batch_queue is for."""
    if "gpu_sm_percent" in given(args):  # its default too: a share given is one applied, or refused
        check_sm_share(args.gpu_share, "--gpu-sm-percent")
    if "zmq_secret" not in derived:  # first: a missing secret is said before any model is resolved
        derived["zmq_secret"] = zmq_secret(args)
    # no --model: the flags only give every model its engine settings
    with_model = not (args.config or (args.model_repo and not args.model))
    if not with_model:
        _check_no_model_flags(args)
    queue_flag, queue_given = args.pipeline_batch_queue, "pipeline_batch_queue" in given(args)
    scales_flag, scales_given = args.calculate_kv_scales, "calculate_kv_scales" in given(args)
    if args.config:  # the flags are for the models that pipeline / whose KV is fp8, judged once the file gives each
        args = argparse.Namespace(**vars(args) | {
            "pipeline_batch_queue": queue_flag and args.pipeline_parallel_size > 1, "calculate_kv_scales": False,
            GIVEN: given(args) - {"pipeline_batch_queue", "calculate_kv_scales"}})
    elif not with_model:  # --model-repo alone: the flag is for the models the admin API loads whose KV is fp8
        args = argparse.Namespace(**vars(args) | {"calculate_kv_scales": False,
                                                  GIVEN: given(args) - {"calculate_kv_scales"}})
    engine, name, model_dir = engine_config_from_args(args, with_model=with_model)
    depends.check_given(engine, ENGINE_NEEDS, given(args))
    later_kv_scales = scales_flag and not with_model and _scales_for_later_loads(engine, strict=not args.config)
    more: list[StartupModel] = []
    specs: list[ModelSpec] = []  # registered (if absent) so evicted or lazy models can be loaded again
    parallel: dict[str, tuple[int, int]] = {}
    queues: dict[str, bool] = {}
    scales: dict[str, bool] = {}
    model_repo = args.model_repo
    if name:
        _check_group(engine, None, "argument --tensor-parallel-size", "argument --pipeline-parallel-size")
    if args.config:
        repo, served = load_serve_config(args.config)
        model_repo = model_repo or (str(repo.root) if repo is not None else None)
        for i, m in enumerate(served):
            sizes = (m.tensor_parallel_size or engine.tensor_parallel_size,
                     m.pipeline_parallel_size or engine.pipeline_parallel_size)
            parallel[m.name] = sizes
            where = f"{args.config}: models[{i}]"
            queues[m.name] = _batch_queue(m, sizes[1], m.pipeline_parallel_size or other_pipeline, queue_flag,
                                          f"{where}.pipeline_batch_queue")
            specs.append(ModelSpec(name=m.name, version=m.version, path="" if m.version else m.path,
                                   dtype=m.dtype, quantization=m.quantization, kv_cache_dtype=m.kv_cache_dtype,
                                   pinned=m.pinned, min_replicas=m.min_replicas,
                                   keep_alive_s=m.keep_alive_s, updated=time.time()))
            m.path = m.path if m.version else resolve_model(m.path, "auto").path
            model = dataclasses.replace(engine.model, model=m.path, served_model_name=m.name,
                                        dtype=m.dtype if m.dtype != "auto" else engine.model.dtype,
                                        quantization=m.quantization or engine.model.quantization,
                                        load_format="dummy" if m.path.startswith("dummy:") else "auto")
            cache = dataclasses.replace(engine.cache, kv_cache_dtype=m.kv_cache_dtype or engine.cache.kv_cache_dtype,
                                        calculate_kv_scales=False)
            scales[m.name] = _kv_scales(m, cache.kv_cache_dtype, sizes, scales_flag, where)
            cache = dataclasses.replace(cache, calculate_kv_scales=scales[m.name])
            # its cache first: the worker's calculated scales would be refused beside the model's own ranks
            model_engine = dataclasses.replace(engine, model=model, cache=cache).with_parallel_sizes(*sizes,
                                                                                                     queues[m.name])
            # a lazy model too: its group is checked now, not when its first request waits for it
            _check_device(m.device, engine.device, f"{where}.device")
            _check_group(model_engine, repo.root if m.version and repo is not None else None,
                         f"{where}.tensor_parallel_size" if m.tensor_parallel_size else "argument --tensor-parallel-size",
                         f"{where}.pipeline_parallel_size" if m.pipeline_parallel_size else
                         "argument --pipeline-parallel-size", m.name)
            if m.lazy:
                continue
            more.append(StartupModel(m.name, model_engine, _tokenizer_dir(m.path),
                                     version=m.version, pinned=m.pinned, keep_alive_s=m.keep_alive_s))
        if queue_given and engine.pipeline_parallel_size == 1 and \
                all(pipeline == 1 for _tensor, pipeline in parallel.values()):
            raise ConfigError(f"argument --pipeline-batch-queue: only with --pipeline-parallel-size 2 or more, or a "
                              f"model of {args.config} with a pipeline_parallel_size of 2 or more (with 1 there is no "
                              "pipeline to keep filled)")
        fp8 = [m.name for m in served if (m.kv_cache_dtype or engine.cache.kv_cache_dtype) != "auto"]
        if scales_given and not fp8 and (engine.cache.kv_cache_dtype == "auto" or model_repo is None):
            raise ConfigError(f"argument --calculate-kv-scales: only with a model whose KV cache is fp8 (--kv-cache-dtype "
                              f"fp8, or a model of {args.config} with a kv_cache_dtype of fp8; auto stores K and V "
                              "unscaled)")
    values = {**worker_values(args, flags), "role": role, "engine": engine, "model_name": name,
              "model_path": model_dir, "more_models": more, "model_repo": model_repo, "register": specs,
              "parallel_sizes": parallel, "batch_queues": queues, "calculated_kv_scales": scales,
              "later_kv_scales": later_kv_scales, "freeze_gc": True, **derived}
    config = build(WorkerConfig, values, flags)
    depends.check_given(config, WORKER_NEEDS, given(args))
    return config


# --model's own: each model of --config (or of the repository) comes with its path, name, tokenizer and format
MODEL_FLAGS = ("--model", "--served-model-name", "--tokenizer", "--load-format")


def _batch_queue(model: ServedModel, pipeline: int, other: int, flag: bool, key: str) -> bool:
    """Whether ``model`` of a models file keeps the pipeline batch queue in a worker where its pipeline size is
    ``pipeline`` (``other`` in serve's other role): its own key, which a model of one stage in both is refused
    (given at all, as a flag is), else the flag's, which takes every model that has a pipeline."""
    if model.pipeline_batch_queue is None:
        return flag and pipeline > 1
    if pipeline == 1 and other == 1:
        raise ConfigError(f"{key}: {model.name}: only with a pipeline_parallel_size of 2 or more (this model's is 1: "
                          "no pipeline to keep filled)")
    return model.pipeline_batch_queue and pipeline > 1


def _scales_for_later_loads(engine: EngineConfig, strict: bool) -> bool:
    """Whether --calculate-kv-scales reaches the models loaded after the worker starts that no models file lists
    (the admin API's): each whose KV is fp8 calculates its scales, one of an unscaled cache runs without
    (model_loads.py), whatever the worker's own --kv-cache-dtype, since a registered model may bring its own. Not
    beside the worker's tensor or pipeline parallelism, where those models would have ranks: refused with
    --model-repo alone (``strict``), left out with a models file, whose models the flag may still reach."""
    if engine.tensor_parallel_size * engine.pipeline_parallel_size == 1:
        return True
    if strict:
        raise ConfigError("argument --calculate-kv-scales: not with --tensor-parallel-size or "
                          "--pipeline-parallel-size above 1 (each rank computes only its own heads or layers)")
    return False


def _kv_scales(model: ServedModel, kv_cache_dtype: str, sizes: tuple[int, int], flag: bool, where: str) -> bool:
    """Whether ``model`` of a models file calculates its KV scales: its own key, which a model of an unscaled KV
    cache is refused (given at all, as a flag is), else the flag's, which takes every model whose KV is fp8. Either
    is refused for a model of several ranks, whose rank 0 alone would see only its own heads or layers; under serve
    the decode worker's sizes may give a model ranks there alone, refused there rather than measured on one side."""
    key = f"{where}.calculate_kv_scales"
    if model.calculate_kv_scales is not None and kv_cache_dtype == "auto":
        raise ConfigError(f"{key}: {model.name}: only with a kv_cache_dtype of fp8 (this model's is auto: K and V "
                          "are stored unscaled)")
    calculate = model.calculate_kv_scales if model.calculate_kv_scales is not None else \
        flag and kv_cache_dtype != "auto"
    if calculate and sizes[0] * sizes[1] > 1:
        who, out = (key, "") if model.calculate_kv_scales else \
            (f"argument --calculate-kv-scales: {where}", "; calculate_kv_scales: false keeps it out of the flag")
        raise ConfigError(f"{who}: {model.name}: not with a tensor_parallel_size or pipeline_parallel_size above 1 "
                          f"(this model's are {sizes[0]} and {sizes[1]}: each rank computes only its own heads or "
                          f"layers{out})")
    return calculate


def _check_no_model_flags(args: argparse.Namespace) -> None:
    for option in MODEL_FLAGS:
        if option.removeprefix("--").replace("-", "_") in given(args):
            raise ConfigError(f"argument {option}: not with --config, which lists each model with its own path and "
                              "name (its tokenizer and format come with it)" if args.config else
                              f"argument {option}: only with --model (--model-repo alone starts the worker empty; "
                              "each model it loads comes with its own)")


def _check_group(engine: EngineConfig, root: Path | None, tp_key: str, pp_key: str, model: str = "") -> None:
    """A tensor- or pipeline-parallel group its model cannot form (a size that does not divide its heads, a
    stage with no layers, more ranks than devices, a quantized model): one line naming the key, before any
    process starts or any weight loads."""
    if engine.tensor_parallel_size * engine.pipeline_parallel_size == 1:
        return
    from kvrelay.shared.engine.ranks.checks import check_group

    try:
        check_group(engine, root)
    except (ValueError, OSError) as exc:
        message = str(exc)
        key = pp_key if "pipeline_parallel_size" in message and "tensor_parallel_size" not in message else tp_key
        raise ConfigError(f"{key}: {model + ': ' if model else ''}{message}") from None


def _check_device(model: str, device: str, key: str) -> None:
    """Every model of a worker runs on the worker's ``device``: a model's own other than it (or auto) is refused."""
    def index(name: str) -> str:
        return "cuda:0" if name == "cuda" else name

    if model != "auto" and index(model) != index(device):
        raise ConfigError(f"{key}: {model}, but this worker runs on {device} (--device), as every model it hosts does")


def _tokenizer_dir(path: str) -> str:
    if path.startswith("dummy:"):
        from kvrelay.shared.repo.model_source import dummy_tokenizer_dir

        return str(dummy_tokenizer_dir(path.removeprefix("dummy:")))
    return str(Path(path))
