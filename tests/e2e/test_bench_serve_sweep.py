"""``kvrelay bench serve --sweep`` on the tiny model: both serving modes launched as real ``kvrelay serve``
processes in one call, each searched on its one running server, then the offline engine's capacity on
the same prompts. The SLOs are loose enough that no trial on a loaded CI box misses them, so the search
doubles until its trial cap: the test checks the table, the JSON and where the search stopped, never a
latency (the search's bisection is tests/unit/test_goodput_search.py's)."""

import json

import pytest

from kvrelay.cli import main

pytestmark = pytest.mark.slow
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--num-gpu-blocks-override", "4096"]
REQUESTS, INPUT_LEN, OUTPUT_LEN, START, TRIALS = 6, 24, 8, 8.0, 3
MODES = ("disaggregated", "unified")


def test_sweep_searches_each_mode_on_one_server_and_reports_a_fraction_of_offline(tiny_dir, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    code = main(["--log-level", "WARNING", "bench", "serve", "--launch", *MODES, "--sweep", "--compare-offline",
                 "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--sweep-requests", str(REQUESTS),
                 "--sweep-start", str(START), "--sweep-max-trials", str(TRIALS),
                 "--slo-ttft-ms", "600000", "--slo-itl-ms", "600000", "--json", str(out),
                 "--", "--model", str(tiny_dir), *ENGINE])
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads(out.read_text())["sweep"]
    assert doc["slo"] == {"p99_ttft_ms": 600000, "p99_itl_ms": 600000}
    assert doc["search"]["requests_per_trial"] == REQUESTS
    offline = doc["offline"]
    assert (offline["completed"], offline["failed"]) == (REQUESTS, 0) and offline["request_throughput"] > 0
    assert [m["label"] for m in doc["modes"]] == list(MODES)
    for mode in doc["modes"]:
        label = mode["label"]
        # every trial went to the server started once for this mode: no restart per rate
        assert printed.count(f"launched kvrelay serve --mode {label} ") == 1
        assert mode["model_id"] == "tiny"
        # nothing fails such SLOs, so the rate doubles until the cap ends the search with a lower bound
        assert [t["rate"] for t in mode["trials"]] == [START * 2 ** i for i in range(TRIALS)]
        assert (mode["found_rate"], mode["lowest_failing_rate"]) == (START * 2 ** (TRIALS - 1), None)
        assert (mode["trials_run"], mode["stopped"]) == (TRIALS, "trial cap")
        assert mode["offline_fraction"] == pytest.approx(mode["found_rate"] / offline["request_throughput"])
        for t in mode["trials"]:
            assert (t["completed"], t["failed"], t["passed"], t["missed"]) == (REQUESTS, 0, True, [])
            # ITL from the streamed chunks: OUTPUT_LEN - 1 gaps per request, each a real interval
            assert 0 < t["median_itl_ms"] <= t["p99_itl_ms"] and 0 < t["median_ttft_ms"] <= t["p99_ttft_ms"]
        # its table: a header, one row per trial in the order run, the found rate
        # (less the TTFT stage rows under each trial's: tests/e2e/test_bench_serve_ttft_stages.py reads those)
        table = [line for line in printed.split(f"Goodput sweep ({label})")[1].splitlines()
                 if not line.startswith(" " * 5)]
        assert table[1].split() == ["trial", "rate", "req/s", "done", "req/s", "TTFT", "p50", "TTFT", "p99",
                                    "ITL", "p50", "ITL", "p99", "result"]
        rows = [line.split() for line in table[2:2 + TRIALS]]
        assert [(r[0], float(r[1]), r[-1]) for r in rows] == [(str(i + 1), t["rate"], "pass")
                                                              for i, t in enumerate(mode["trials"])]
        assert table[2 + TRIALS].startswith(f"{label}: highest rate meeting the SLOs {mode['found_rate']:g} req/s")
    summary = printed.split("Goodput: highest rate meeting the SLOs")[1].splitlines()
    for mode, line in zip(doc["modes"], summary[2:4], strict=True):
        assert line.split()[:2] == [mode["label"], f"{mode['found_rate']:g}"]
        assert line.split()[-1] == f"{mode['offline_fraction']:.2f}x"


def test_sweep_refuses_a_fixed_rate():
    with pytest.raises(SystemExit, match="--sweep-start, not --request-rate"):
        main(["bench", "serve", "--sweep", "--request-rate", "8"])
