"""What the ``kvrelay`` command says about itself: its version, and what each benchmark prints, which must
match the benchmark's own flags (a baseline promised in the help is one the benchmark runs)."""

import argparse
import importlib
import importlib.metadata
import subprocess
import sys

from kvrelay.cli import BENCHES


def kvrelay(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", *argv], capture_output=True, text=True, timeout=120)


def test_version():
    proc = kvrelay("--version")
    assert proc.returncode == 0 and proc.stdout == f"kvrelay {importlib.metadata.version('kvrelay')}\n"


def test_bench_help_says_what_each_prints_and_which_flag_adds_a_baseline():
    proc = kvrelay("bench", "--help")
    assert proc.returncode == 0
    assert "same-run baseline" not in proc.stdout  # not every benchmark prints one by default
    for kind, (module, _, help) in BENCHES.items():
        assert f"{kind}: {help}" in proc.stdout
        parser = argparse.ArgumentParser()
        importlib.import_module(module).add_args(parser)
        flags = {o: a for a in parser._actions for o in a.option_strings}
        if "--baseline" in flags:  # off by default: the help must say how to get it
            assert flags["--baseline"].default == "none" and "with --baseline hf" in help, kind
        if "--compare-offline" in flags:
            assert flags["--compare-offline"].default is False and "--compare-offline adds" in help, kind


def test_a_benchmarks_flags_reach_it_verbatim_dashes_included(monkeypatch):
    # `kvrelay bench serve -- --max-num-seqs 8`: after `--` come engine flags for the servers it
    # launches; argparse's remainder would drop that `--` and hand the flags to the bench's own parser
    from kvrelay import cli

    seen = []
    monkeypatch.setattr(cli, "_run_bench", lambda args: seen.append((args.bench_kind, args.bench_args)) or 0)
    assert cli.main(["--log-level", "WARNING", "bench", "serve", "--", "--max-num-seqs", "8"]) == 0
    assert cli.main(["bench", "swap", "--after", "1", "--", "--max-num-seqs", "0"]) == 0
    assert seen == [("serve", ["--", "--max-num-seqs", "8"]), ("swap", ["--after", "1", "--", "--max-num-seqs", "0"])]
