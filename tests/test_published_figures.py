"""benchmarks/published_figures.py: every setup is a config the recipes parse, on a shipped
architecture, with its source cited; the table lands between the doc's markers."""

from __future__ import annotations

import importlib
import re

import pytest
import yaml

from benchmarks import published_figures as pf
from lightning_mem.assets import HUB_ASSETS
from tests.helpers import REPO


def test_there_are_at_least_five_figures_each_cited():
    assert len(pf.SETUPS) >= 5 and len({s.name for s in pf.SETUPS}) == len(pf.SETUPS)
    for setup in pf.SETUPS:
        assert re.search(r"https://\S+", setup.source) and setup.published_bytes > 0 and setup.unmatched, setup.name
    assert {s.name.split("-")[0] for s in pf.SETUPS} >= {"litgpt", "torchtune", "torchao", "qlora"}


@pytest.mark.parametrize("setup", pf.SETUPS, ids=lambda s: s.name)
def test_each_setup_is_a_config_the_recipe_parses(setup, capsys):
    config = REPO / setup.config
    recipe = importlib.import_module(f"recipes.{config.parent.name}")
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["fit", "--config", str(config), *setup.overrides, "--print_config"])
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err
    parsed = yaml.safe_load(captured.out)
    hub_id = parsed["model"]["name_or_path"]
    assert (HUB_ASSETS / hub_id / "config.json").is_file(), hub_id  # estimated offline, from a shipped architecture
    for override in setup.overrides:  # what the setup says is what the parser kept
        key, _, value = override.removeprefix("--").partition("=")
        node = parsed
        for part in key.split("."):
            node = node[part]
        if isinstance(node, dict) and "class_path" in node:  # `--model.optimizer=torch.optim.AdamW`
            node = node["class_path"]
        elif isinstance(node, list) and node and isinstance(node[0], dict):  # callbacks
            node = [{"class_path": c["class_path"]} for c in node]
        assert node == yaml.safe_load(value), (key, node, value)


def _row(name, ratio, **extra):
    setup = next(s for s in pf.SETUPS if s.name == name)
    return {"name": name, "estimated_bytes": int(ratio * setup.published_bytes), "ratio": ratio,
            "bound": setup.bound, **extra}


def test_the_table_is_written_between_the_markers(tmp_path):
    setups = {s.name: s for s in pf.SETUPS}
    rows = [_row("litgpt-llama2-7b-lora", 0.96),
            _row("qlora-paper-llama-65b", 0.94, fits_bound=False, paged_bytes=6 << 30,
                 on_device_bytes=int(0.94 * 48 * 2**30) + (6 << 30), on_device_ratio=1.065),
            {"name": "torchao-llama2-7b-adamw", "published": "x", "error": "ValueError: no"}]
    table = pf.markdown(rows, setups, date="2026-01-01", versions="v")
    lines = [line for line in table.splitlines() if line.startswith("| `")]
    assert lines[0].startswith("| `litgpt-llama2-7b-lora` | 21.30 GB | 20.45 GB | 0.96 | not paged |")
    assert "| 45.12 GiB | 0.94 (does not fit with the margin) | 51.12 GiB (1.06) with 6.00 GiB of paged state |" in lines[1]
    assert "| error: ValueError: no | n/a | n/a |" in lines[2]
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{pf.BEGIN}\nold table\n{pf.END}\nafter\n")
    pf.write_into(doc, table)
    assert doc.read_text() == f"before\n{pf.BEGIN}\n{table}{pf.END}\nafter\n"
    assert pf.BEGIN in pf.DOC.read_text() and pf.END in pf.DOC.read_text()  # the doc keeps its markers


def test_merging_rows_replaces_or_adds_them_in_setup_order_dated_where_the_day_differs(tmp_path):
    setups = {s.name: s for s in pf.SETUPS}
    table = pf.markdown([_row("litgpt-llama2-7b-lora", 0.96), _row("qlora-paper-llama-65b", 0.94, fits_bound=True)],
                        setups, date="2026-01-01", versions="v")
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{pf.BEGIN}\n{table}{pf.END}\nafter\n")
    pf.merge_into(doc, [_row("torchtune-llama3.1-8b-full", 1.01), _row("litgpt-llama2-7b-lora", 0.5)], date="2026-01-02")
    pf.merge_into(doc, [_row("qlora-paper-llama-65b", 0.9, fits_bound=True)], date="2026-01-01")
    text = doc.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["litgpt-llama2-7b-lora", "torchtune-llama3.1-8b-full", "qlora-paper-llama-65b"]
    assert "| 10.65 GB (2026-01-02) | 0.50 |" in rows[0] and "(2026-01-02) | 1.01 |" in rows[1]
    assert "GiB | 0.90 (fits" in rows[2] and "2026-01" not in rows[2]
    bullets = [line.split("`")[1] for line in text.splitlines() if line.startswith("- `")]
    assert bullets == ["litgpt-llama2-7b-lora", "torchtune-llama3.1-8b-full", "qlora-paper-llama-65b"]
    assert text.startswith(f"before\n{pf.BEGIN}\nEstimated 2026-01-01") and text.endswith(f"{pf.END}\nafter\n")


def test_merging_rows_brings_the_prose_and_column_names_up_to_date(tmp_path):
    setups = {s.name: s for s in pf.SETUPS}
    table = pf.markdown([_row("litgpt-llama2-7b-lora", 0.96)], setups, date="2026-01-01", versions="v")
    old = table.replace("with the paged optimizer state on the device", "paged optimizer state left out")
    doc = tmp_path / "doc.md"
    doc.write_text(f"{pf.BEGIN}\n{old}{pf.END}\n")
    pf.merge_into(doc, [_row("litgpt-llama2-7b-lora", 0.5)], date="2026-01-01")
    text = doc.read_text()
    assert "paged optimizer state left out" not in text and "| with the paged optimizer state on the device |" in text
    assert text.splitlines()[1] == table.splitlines()[0]  # the table's own first line (day, versions) stays
    assert len([ln for ln in text.splitlines() if ln.startswith("|---")]) == 1
