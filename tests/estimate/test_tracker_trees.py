"""The tracker's own walk of an operator's arguments and outputs gives what torch's pytree gives."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

from lightning_mem.estimate.tracker import leaves_of, map_leaves

_CASES = [
    pytest.param(([torch.ones(2), 3], {"dim": 1, "keepdim": True}), id="args-and-kwargs"),
    pytest.param((None, 1, [2, {"b": 3, "a": None}], torch.float32, slice(1, 2)), id="nested, dict order kept"),
    pytest.param(torch.ones(1), id="a bare tensor"),
    pytest.param((1, torch.Size([2, 3])), id="torch.Size, a node of pytree's own"),
    pytest.param((torch.return_types.max((torch.ones(1), torch.zeros(1))),), id="a structseq"),
    pytest.param(collections.OrderedDict(a=torch.ones(1), b=[2]), id="an OrderedDict"),
    pytest.param(collections.namedtuple("Pair", "x y")(1, [2, 3]), id="a namedtuple"),
]


@pytest.mark.parametrize("tree", _CASES)
def test_leaves_are_pytrees_leaves_in_its_order(tree):
    expected = tree_flatten(tree)[0]
    got = leaves_of(tree)
    assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected))


@pytest.mark.parametrize("tree", _CASES)
def test_map_rebuilds_what_tree_map_rebuilds(tree):
    def tag(leaf):  # ints stay ints: torch.Size rebuilds only from them
        return leaf * 2 if type(leaf) is int else ("leaf", id(leaf))

    got, expected = map_leaves(tag, tree), tree_map(tag, tree)
    assert type(got) is type(expected) and got == expected
