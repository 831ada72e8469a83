"""The worker's, gateway's and serve's own settings that take effect only under another setting's value
(shared/config/depends.py), --model's flags beside --config, and a models file's per-model device: refused in one
line naming both keys where they would have none, before anything loads; taken beside the setting that enables
them; never tripped by a default. (The engine's: test_setting_needs.py.)"""

import json
import re

import pytest
from pydantic import ValidationError

from kvrelay.cli import main
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV
from tests.unit.serve_children import serve_children, setting_at

TINY = ["--model", "dummy:tiny-llama", "--device", "cpu"]
ONE_MODEL = "only on a worker of several models (--config listing two or more, or --model-repo), which share its memory"
SEVERAL = "only on a worker of one model (several share one KV pool of --kv-cache-memory bytes)"
NO_AFFINITY = "only with prefix affinity (--no-prefix-affinity routes no prompt by it)"

WORKER_REFUSED = [  # (command line, the line)
    (["decode-worker", *TINY, "--encrypt-kv-frames", "--kv-frames-port", "5601"],
     "argument --kv-frames-port: not with --encrypt-kv-frames (KV frames come on the CURVE socket)"),
    (["decode-worker", *TINY, "--encrypt-kv-frames", "--kv-frame-streams", "2"],
     "argument --kv-frame-streams: not with --encrypt-kv-frames (KV frames come on the CURVE socket)"),
    (["decode-worker", *TINY, "--kv-frames-port", "65530", "--kv-frame-streams", "8"],
     "argument --kv-frames-port: 8 sockets (--kv-frame-streams) from port 65530 run past 65535"),
    (["decode-worker", *TINY, "--weights-memory", "1000000"], f"argument --weights-memory: {ONE_MODEL}"),
    (["decode-worker", *TINY, "--min-residency-s", "15"], f"argument --min-residency-s: {ONE_MODEL}"),
    (["decode-worker", *TINY, "--no-verify-checksums"], "argument --verify-checksums: only with a model repository "
     "(--model-repo, or a --config's model_repo): only its models have manifests"),
    (["decode-worker", *TINY, "--metrics-tenant-labels"], "argument --metrics-tenant-labels: only with "
     "--monitoring-port (without it the worker serves no /metrics)"),
    (["unified-worker", *TINY, "--model-repo", "{repo}", "--num-gpu-blocks-override", "64"],
     f"argument --num-gpu-blocks-override: {SEVERAL}"),
    (["unified-worker", *TINY, "--num-gpu-blocks-override", "64", "--kv-cache-memory", "1000000"],
     "argument --kv-cache-memory: not with --num-gpu-blocks-override, which sets the KV cache's size"),
    (["gateway", "--response-cache-max-bytes", "10"],
     "argument --response-cache-max-bytes: only with --response-cache-ttl above 0 (0: no response is cached)"),
    (["gateway", "--redis-replica-wait-ms", "100"],
     "argument --redis-replica-wait-ms: only with --redis-min-replicas above 0 (0: no job write waits for replicas)"),
    (["gateway", "--no-prefix-affinity", "--affinity-slack", "3"], f"argument --affinity-slack: {NO_AFFINITY}"),
    (["gateway", "--no-prefix-affinity", "--affinity-prefix-tokens", "256"],
     f"argument --affinity-prefix-tokens: {NO_AFFINITY}"),
]
TAKEN = [  # (command line, the setting's path in the printed config, its value there)
    (["decode-worker", *TINY, "--kv-frames-port", "5601"], ("kv_frames_port",), 5601),
    (["decode-worker", *TINY, "--kv-frames-port", "5601", "--kv-frame-streams", "3"], ("kv_frame_streams",), 3),
    (["decode-worker", *TINY, "--model-repo", "{repo}", "--weights-memory", "1000000"], ("weights_memory",), 1000000),
    (["decode-worker", *TINY, "--model-repo", "{repo}", "--min-residency-s", "3"], ("min_residency_s",), 3),
    (["decode-worker", *TINY, "--model-repo", "{repo}", "--no-verify-checksums"], ("verify_checksums",), False),
    (["decode-worker", *TINY, "--monitoring-port", "0", "--metrics-tenant-labels"], ("metrics_tenant_labels",), True),
    (["unified-worker", *TINY, "--num-gpu-blocks-override", "64"], ("engine", "cache", "num_gpu_blocks"), 64),
    (["unified-worker", *TINY, "--model-repo", "{repo}", "--kv-cache-memory", "1000000"],
     ("engine", "cache", "kv_cache_memory"), 1000000),
    (["gateway", "--response-cache-ttl", "5", "--response-cache-max-bytes", "10"], ("response_cache_max_bytes",), 10),
    (["gateway", "--redis-min-replicas", "1", "--redis-replica-wait-ms", "50"], ("redis_replica_wait_ms",), 50),
    (["gateway", "--affinity-slack", "3"], ("affinity_slack",), 3),
]


def _argv(argv: list[str], repo) -> list[str]:
    return [a.format(repo=repo) for a in argv]


@pytest.mark.parametrize("argv,said", WORKER_REFUSED)
def test_a_role_refuses_a_flag_its_other_setting_leaves_without_effect_in_one_line(capsys, tmp_path, argv, said):
    assert main([*_argv(argv, tmp_path), "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"kvrelay {argv[0]}: error: {said}"]


# serve's own command line: every role's settings; a unified worker's are the other workers' (one model, kv-cache),
# and --metrics-tenant-labels is the gateway's too (test_serve_gives_tenant_names_to_the_workers_that_serve_metrics)
@pytest.mark.parametrize("argv,said", [a for a in WORKER_REFUSED if a[0][0] != "unified-worker"
                                       and "--metrics-tenant-labels" not in a[0]])
def test_serve_refuses_it_before_any_process_starts(tmp_path, argv, said):
    with pytest.raises(ConfigError) as err:
        serve_children(["--model", "dummy:tiny-llama", *_argv(argv[1:], tmp_path)])
    assert str(err.value) == said


@pytest.mark.parametrize("argv,path,value", TAKEN)
def test_with_the_setting_that_enables_it_the_flag_is_taken(capsys, tmp_path, argv, path, value):
    assert main([*_argv(argv, tmp_path), "--print-config"]) == 0, capsys.readouterr().err
    assert setting_at(json.loads(capsys.readouterr().out), path) == value


def test_insecure_zmq_refuses_encrypted_kv_frames_and_their_port(monkeypatch, capsys):
    monkeypatch.delenv(ZMQ_SECRET_ENV, raising=False)
    for flags, said in ((["--encrypt-kv-frames"], "argument --encrypt-kv-frames: not with --insecure-zmq (no CURVE "
                                                  "socket to encrypt them on)"),
                        (["--kv-frames-port", "0"], "argument --kv-frames-port: not with --insecure-zmq (KV frames "
                                                    "come on the one ZMQ socket)")):
        assert main(["decode-worker", *TINY, "--insecure-zmq", *flags, "--print-config"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"kvrelay decode-worker: error: {said}"]


@pytest.mark.parametrize("value,said", [("0", "Input should be greater than or equal to 1 (got '0')"),
                                        ("17", "Input should be less than or equal to 16 (got '17')"),
                                        ("four", "Input should be a valid integer, unable to parse string as an "
                                                 "integer (got 'four')")])
def test_a_kv_frame_stream_count_out_of_range_is_one_line_before_anything_loads(capsys, value, said):
    with pytest.raises(SystemExit) as exc:
        main(["decode-worker", *TINY, "--kv-frame-streams", value, "--print-config"])
    assert exc.value.code == 2
    said = f"kvrelay decode-worker: error: argument --kv-frame-streams: {said}"
    assert capsys.readouterr().err.splitlines() == [said]


def test_a_config_built_whole_refuses_a_value_that_would_have_no_effect():
    engine = EngineConfig(ModelConfig("m"), device="cpu")
    with pytest.raises(ValidationError, match=re.escape(f"argument --weights-memory: {ONE_MODEL}")):
        WorkerConfig("decode", engine, weights_memory=1 << 30)
    with pytest.raises(ValidationError, match=re.escape(f"argument --affinity-slack: {NO_AFFINITY}")):
        GatewayConfig(prefix_affinity=False, affinity_slack=2)
    assert GatewayConfig(prefix_affinity=False).affinity_slack == 8  # the default never trips


def test_serve_refuses_a_state_dir_beside_an_external_redis(tmp_path):
    with pytest.raises(ConfigError) as err:
        serve_children(["--model", "dummy:tiny-llama", "--redis-url", "redis://127.0.0.1:6379/0", "--state-dir",
                        str(tmp_path)])
    assert str(err.value) == ("argument --state-dir: only with the embedded Redis (--redis-url, or $KVRELAY_REDIS_URL, "
                              "names another, which keeps its own data)")
    assert serve_children(["--model", "dummy:tiny-llama", "--state-dir", str(tmp_path)])


@pytest.mark.parametrize("device,refused", [("auto", False), ("cpu", False), ("cuda", True), ("cuda:1", True)])
def test_a_models_file_device_other_than_the_workers_is_refused(capsys, tmp_path, device, refused):
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - {{name: a, path: 'dummy:tiny-llama', device: '{device}'}}\n"
                      "  - {name: b, path: 'dummy:tiny-llama'}\n")
    code = main(["unified-worker", "--device", "cpu", "--config", str(models), "--print-config"])
    if not refused:
        assert code == 0 and json.loads(capsys.readouterr().out)["more_models"][0]["engine"]["device"] == "cpu"
        return
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvrelay unified-worker: error: {models}: models[0].device: {device}, but this worker runs on cpu "
        "(--device), as every model it hosts does"]


def test_serve_gives_tenant_names_to_the_workers_that_serve_metrics():
    def labels(argv):
        children = serve_children(["--model", "dummy:tiny-llama", "--metrics-tenant-labels", *argv])
        return {command: child.config.metrics_tenant_labels for command, child in children.items()}

    assert labels([]) == {"gateway": True, "prefill-worker": False, "decode-worker": False}
    assert labels(["--worker-monitoring-port", "9500"]) == {"gateway": True, "prefill-worker": True,
                                                            "decode-worker": True}


@pytest.mark.parametrize("flags", [["--model", "dummy:tiny-llama"], ["--served-model-name", "x"],
                                   ["--tokenizer", "{repo}"], ["--load-format", "auto"]])
def test_model_flags_are_refused_where_the_models_come_with_their_own(capsys, tmp_path, flags):
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - {name: a, path: 'dummy:tiny-llama'}\n")
    flags = _argv(flags, tmp_path)
    assert main(["unified-worker", "--device", "cpu", "--config", str(models), *flags, "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvrelay unified-worker: error: argument {flags[0]}: not with --config, which lists each model with its own "
        "path and name (its tokenizer and format come with it)"]
    with pytest.raises(ConfigError, match=f"^argument {flags[0]}: not with --config"):
        serve_children(["--device", "cpu", "--config", str(models), *flags])
    if flags[0] != "--model":  # with --model they are that model's
        assert main(["unified-worker", "--device", "cpu", "--model-repo", str(tmp_path), *flags, "--print-config"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"kvrelay unified-worker: error: argument {flags[0]}: only with --model (--model-repo alone starts the worker "
            "empty; each model it loads comes with its own)"]
        assert main(["unified-worker", *TINY, "--model-repo", str(tmp_path), *flags, "--print-config"]) == 0


def test_serve_refuses_a_crash_window_where_the_first_crash_stops_everything():
    with pytest.raises(ConfigError) as err:
        serve_children(["--model", "dummy:tiny-llama", "--max-crashes", "1", "--crash-window", "300"])
    assert str(err.value) == ("argument --crash-window: only with --max-crashes 2 or more (1: the first crash stops "
                              "everything, whenever it comes)")
    assert serve_children(["--model", "dummy:tiny-llama", "--max-crashes", "2", "--crash-window", "300"])
    assert serve_children(["--model", "dummy:tiny-llama", "--max-crashes", "1"])
