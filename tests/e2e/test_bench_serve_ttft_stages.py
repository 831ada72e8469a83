"""``kvrelay bench serve --sweep`` prints, under each trial's row, the server's split of that trial's TTFT
into stages (gateway/ttft_stages.py, read from the gateway's /metrics by bench/ttft_stages.py), for both
serving modes on the tiny model, at the one rate --sweep-rates names. A consistency check, never a timing one: every request of the trial is
split, no stage is negative, and the stages' means add up to the gateway's own mean TTFT."""

import json

import pytest

from kvrelay.cli import main
from kvrelay.gateway.ttft_stages import STAGES

pytestmark = pytest.mark.slow
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--num-gpu-blocks-override", "4096"]
REQUESTS, INPUT_LEN, OUTPUT_LEN, RATE = 8, 24, 4, 8.0
MODES = ("disaggregated", "unified")


def test_each_trial_reports_its_ttft_stages(tiny_dir, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    code = main(["--log-level", "WARNING", "bench", "serve", "--launch", *MODES, "--sweep",
                 "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--sweep-requests", str(REQUESTS),
                 "--sweep-rates", str(RATE), "--slo-ttft-ms", "600000", "--slo-itl-ms", "600000",
                 "--json", str(out), "--", "--model", str(tiny_dir), *ENGINE])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for mode in json.loads(out.read_text())["sweep"]["modes"]:
        [trial] = mode["trials"]
        assert (trial["rate"], mode["stopped"]) == (RATE, "as given")  # --sweep-rates: that rate, no search
        b = trial["ttft_stages"]
        assert b["requests"] == REQUESTS  # the warm-up request came before the trial's first scrape
        assert list(b["stages"]) == list(STAGES)
        for stage in STAGES:
            s = b["stages"][stage]
            assert 0 <= s["p50_ms"] <= s["p99_ms"] and s["mean_ms"] >= 0
        total = sum(s["mean_ms"] for s in b["stages"].values())
        # the stages tile each request's TTFT (tests/unit/test_ttft_stages.py), and the gateway observes both
        # at one stamp of the first token: the means agree but for float rounding
        assert total == pytest.approx(b["ttft_mean_ms"], rel=0, abs=0.01)
        tail = b["tail"]
        assert 1 <= tail["requests"] <= REQUESTS and set(tail["mean_ms"]) == set(STAGES)
        assert all(v >= 0 for v in tail["mean_ms"].values())
        rows = printed.split(f"Goodput sweep ({mode['label']})")[1].splitlines()[3:9]
        assert rows[0].split() == ["TTFT", "stages", "(ms,", "server)", *STAGES, "sum"]
        assert [r.split()[0] for r in rows[1:]] == ["p50", "p99", "mean", "gateway", "slowest"]
        assert float(rows[3].split()[-1]) == pytest.approx(total, abs=0.1)


@pytest.mark.parametrize(("argv", "why"), [(["--sweep-rates", "8"], "rates of a --sweep"),
                                            (["--sweep", "--sweep-rates", "8", "0"], "must be positive")])
def test_sweep_rates_are_checked(argv, why):
    with pytest.raises(SystemExit, match=why):
        main(["bench", "serve", *argv])
