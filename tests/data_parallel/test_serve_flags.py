"""`zipage-jax serve`'s data-parallel flags: their values, the usage errors, and a single-process
server that never imports Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import serve

from zipage_jax.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def serve_args(*argv: str):
    return build_parser(["serve", *argv])[0].parse_args(["serve", *argv])


def test_the_flags_default_to_one_engine_in_this_process():
    args = serve_args()
    assert (args.data_parallel_size, args.data_parallel_backend, args.routing_policy) == (1, "ray", "cache_aware")
    args = serve_args("--data-parallel-size", "4", "--data-parallel-backend", "ray", "--routing-policy", "round_robin")
    assert (args.data_parallel_size, args.data_parallel_backend, args.routing_policy) == (4, "ray", "round_robin")


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["--data-parallel-size", "2", "--num-processes", "2", "--coordinator-address", "127.0.0.1:1234",
      "--process-id", "0"], "--data-parallel-size does not combine with --num-processes"),
    (["--routing-policy", "random"], "invalid choice: 'random'"),
    (["--data-parallel-backend", "mp"], "invalid choice: 'mp'"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        serve("--model", "default", *argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_single_process_server_does_not_import_ray(tiny_model_factory):
    code = ("import json, sys, uvicorn\n"
            "uvicorn.Server.run = lambda self, *args, **kwargs: None  # the app is built, not served\n"
            "from zipage_jax.cli import main\n"
            "status = main(['serve', '--model', sys.argv[1], '--port', '0'])\n"
            "print(json.dumps({'status': status, 'ray': 'ray' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_factory("qwen3"))], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"status": 0, "ray": False}
