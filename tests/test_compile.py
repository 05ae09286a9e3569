"""treeops inside ``torch.compile(fullgraph=True)``: a small model step (kv_append, rope,
tree_attention, an LM head, accept_greedy, compact_kv) traces without a graph break and equals
eager. Every op is a ``torch.ops.treeops`` custom op, so the compiled graph calls the same CPU
reference / CUDA kernel as eager does."""

from __future__ import annotations

import pytest
import torch

import treeops

B, N, H_Q, H_KV, D, PAGE, V = 2, 4, 2, 1, 64, 16, 32


def step(q, k, v, k_cache, v_cache, block_table, seq_lens, w_head, *tree_tensors):
    tree = treeops.Tree(*tree_tensors)
    treeops.kv_append(k, v, k_cache, v_cache, block_table, seq_lens, tree.num_nodes, tree.depth)
    q = treeops.rope(q, tree.positions(seq_lens))
    o = treeops.tree_attention(q, k_cache, v_cache, block_table, seq_lens, tree)
    logits = o.reshape(B, N, H_Q * D).float() @ w_head
    acc = treeops.accept_greedy(tree, logits)
    new_lens = treeops.compact_kv(
        k_cache[None], v_cache[None], block_table, seq_lens, tree, acc.accepted, acc.accept_len
    )
    return o, logits, acc.accepted, acc.accept_len, acc.bonus, new_lens


def inputs(device):
    g = torch.Generator().manual_seed(0)
    tree = treeops.Tree.from_parents(
        torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]], dtype=torch.int32),
        torch.tensor([4, 3], dtype=torch.int32),
        torch.tensor([[5, 7, 9, 11], [6, 8, 10, 0]]),
    )
    # the head makes node 0 predict token 7 and node 1 token 11 in request 0 (a 3-token path)
    w = torch.randn(H_Q * D, V, generator=g) * 0.1
    args = [
        torch.randn(B, N, H_Q, D, generator=g),
        torch.randn(B, N, H_KV, D, generator=g),
        torch.randn(B, N, H_KV, D, generator=g),
        torch.randn(4, PAGE, H_KV, D, generator=g),
        torch.randn(4, PAGE, H_KV, D, generator=g),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([9, 20], dtype=torch.int32),
        w,
        *tree.tensors(),
    ]
    return [a.to(device) for a in args]


def run(fn, device):
    args = inputs(device)
    outs = fn(*args)
    return [*outs, args[3], args[4]]  # the caches, written in place


def check_equal(eager, compiled):
    for e, c in zip(eager, compiled, strict=True):
        if e.is_floating_point():
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(c, e)


def test_compiled_step_equals_eager_on_cpu():
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # inductor
    check_equal(run(step, "cpu"), run(compiled, "cpu"))


def test_compiled_graph_calls_the_treeops_ops():
    """The traced graph holds the custom ops themselves (not their decomposition or a break)."""
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(step, fullgraph=True, backend=backend)(*inputs("cpu"))
    names = " ".join(seen)
    for op in ("kv_append", "rope", "tree_attention", "accept_greedy", "compact_kv"):
        assert f"treeops.{op}" in names, (op, names)


@pytest.mark.gpu
def test_compiled_step_equals_eager_on_gpu():
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # inductor
    check_equal(run(step, "cuda"), run(compiled, "cuda"))
