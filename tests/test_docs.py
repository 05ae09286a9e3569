"""Every docstring example of the public modules runs and prints what it shows (CPU; kernels
under the interpreter where an example calls one)."""

import doctest
import importlib

import pytest

MODULES = [
    "treeops.accept",
    "treeops.build_tree",
    "treeops.cast",
    "treeops.compact_kv",
    "treeops.cost_table",
    "treeops.graft",
    "treeops.kv_append",
    "treeops.testing",
    "treeops.tree",
    "treeops.tree_attention",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0
    assert result.attempted > 0  # the module has examples, and they ran
