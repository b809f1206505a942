"""module_tree: the searches over a module tree that the FSDP2 strategy, activation checkpointing
and the memory estimator share (what is a model, which blocks it has, in which order)."""

from __future__ import annotations

from memtest_utils import tiny_llama
from torch import nn

from lightning_mem.module_tree import class_names_in, default_block_classes, find_blocks, find_hf_models, outermost


class Block(nn.Module):
    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.inner = inner


def test_outermost_stops_at_the_first_match_and_names_the_path():
    tree = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(2, 2))))
    found = outermost(tree, lambda m: isinstance(m, nn.Sequential) and m is not tree)
    assert [name for name, _ in found] == ["1"]  # "1.1" lies inside "1"
    assert outermost(tree, lambda m: m is tree) == [("", tree)]  # the root itself, with an empty path
    assert [name for name, _ in outermost(tree, lambda m: isinstance(m, nn.Linear))] == ["0", "1.1.0"]


def test_hf_models_are_found_whole_and_in_order():
    holder = nn.ModuleDict({"policy": tiny_llama(seed=0, layers=2), "head": nn.Linear(4, 1)})
    holder["critic"] = nn.Sequential(tiny_llama(seed=1, layers=2))
    found = find_hf_models(holder)
    assert [name for name, _ in found] == ["policy", "critic.0"]
    assert found[0][1] is holder["policy"]  # the causal LM, not the LlamaModel inside it
    assert find_hf_models(nn.Linear(2, 2)) == []


def test_blocks_in_forward_order_and_nested_blocks_skipped():
    model = tiny_llama(layers=3)
    assert default_block_classes(model) == ["LlamaDecoderLayer"]
    assert find_blocks(model, default_block_classes(model)) == list(model.model.layers)
    assert default_block_classes(nn.Linear(2, 2)) == []

    inner = Block()
    outer, last = Block(inner), Block()
    tree = nn.Sequential(outer, nn.Sequential(last))
    assert find_blocks(tree, ["Block"]) == [outer, last]  # `inner` is sharded with `outer`


def test_class_names_in_every_tree_given():
    names = class_names_in([Block(nn.ReLU()), nn.Linear(2, 2)])
    assert names == {"Block", "Linear", "ReLU"}
