"""Every `zipage-jax bench NAME` parses its own --help (its module imports and adds its flags)."""

from __future__ import annotations

import pytest

from zipage_jax import bench
from zipage_jax.cli import main


@pytest.mark.parametrize("name", list(bench.SUBCOMMANDS))
def test_every_bench_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: zipage-jax bench {name} ")
