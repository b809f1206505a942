"""Every YAML under configs/ parses with its recipe's CLI: a config added later is checked too."""

import importlib
from pathlib import Path

import pytest

from tests.helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*/*.yaml"))


def test_there_are_configs():
    assert any(p.parent.name == "sft" for p in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_parses(config: Path, capsys):
    recipe = importlib.import_module(f"recipes.{config.parent.name}")
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["fit", "--config", str(config), "--print_config"])
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err
    assert "model:" in captured.out and "trainer:" in captured.out
