"""``kvrelay serve``'s gateway count (kvrelay/serve_plan.py): --api-server-count when given; else on a GPU host one
gateway per 4 cores, at most 4, and on the CPU one (its cores are the workers' math)."""

import pytest

from kvrelay.cli import build_parser
from kvrelay.serve_plan import models_to_serve, plan


def gateways(argv: list[str]) -> list[str]:
    args = build_parser().parse_args(["serve", "--model", "dummy:tiny-llama", *argv])
    children = [c for c in plan(args, models_to_serve(args), "redis://127.0.0.1:6379/0") if c.is_gateway]
    assert all(c.config.reuse_port for c in children) == (len(children) > 1)  # several share the port
    return [c.name for c in children]


@pytest.mark.parametrize(("cores", "expected"), [(64, 4), (16, 4), (12, 3), (8, 2), (4, 1), (2, 1)])
def test_a_gpu_host_gets_a_gateway_per_four_cores_at_most_four(monkeypatch, cores, expected):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert len(gateways(["--device", "cuda"])) == expected


def test_the_cpu_gets_one_gateway_and_a_given_count_is_kept(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert gateways(["--device", "cpu"]) == ["gateway"]
    assert gateways(["--device", "cpu", "--api-server-count", "3"]) == ["gateway", "gateway-1", "gateway-2"]
    assert gateways(["--device", "cuda", "--api-server-count", "1"]) == ["gateway"]


def test_a_count_below_one_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        gateways(["--api-server-count", "0"])
    assert "--api-server-count" in capsys.readouterr().err
