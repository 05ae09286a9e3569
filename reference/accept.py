"""Reference acceptance (docs/design.md op 7): greedy and lossless sampling over a batch of draft
trees.

This is the specification the Triton kernels in ``treeops.kernels.accept`` are tested against:
plain PyTorch, one request at a time, probabilities in float64.

What is emitted (both ops). Walk the tree from the root; the walk accepts a path
``root = a_0, a_1, ..., a_{L-1}`` (``L`` nodes, root counted) and draws one more token, the
*bonus*, at ``a_{L-1}``. The emitted tokens are ``e_1 .. e_L = tokens[a_1], ..., tokens[a_{L-1}],
bonus`` -- always exactly ``accept_len`` of them. Then:

* budget: with ``max_new_tokens[b] = M`` (values below 1 count as 1) only ``e_1 .. e_M`` are
  emitted;
* stop ids: if some emitted ``e_j`` is a stop id, emission ends with the first such ``e_j``.

The truncated result is reported in the same form: with ``C`` tokens kept, ``accept_len = C``,
``accepted = a_0 .. a_{C-1}`` and ``bonus = e_C`` -- which is the token of the tree node
``a_C`` when the cut falls inside the tree. So "emitted = accepted non-root tokens, then bonus"
always holds, the next step's root is ``bonus``, and ``compact_kv`` keeps exactly the K/V of
the accepted nodes.
Inactive rows (``num_nodes = 0``) have ``accept_len = 0``, ``bonus = -1``, all ``-1`` accepted.
"""

from __future__ import annotations

import torch

from treeops._accept_inputs import Acceptance, check_accept_inputs

__all__ = ["accept_greedy", "accept_sample", "rank_order", "target_probs"]


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """docs/design.md op 7's target distribution of one node, float64 ``[V]``.

    ``p = softmax(logits / T)``; top-k keeps the ``top_k`` largest (ties: lower id; ``top_k <= 0``
    or ``>= V`` keeps all); top-p keeps the smallest prefix, ordered by ``p`` descending then id
    ascending, whose mass reaches ``top_p`` of the (top-k renormalised) total; renormalised.
    ``T = 0`` gives the one-hot argmax (lowest id among ties).
    """
    x = logits.to(torch.float64)
    V = x.numel()
    if temperature == 0:
        p = torch.zeros(V, dtype=torch.float64)
        p[int(torch.argmax(x))] = 1.0
        return p
    m = x.max()
    w = torch.exp((x - m) / float(temperature))
    keep = V
    if 0 < top_k < V:
        keep = top_k
    elif top_p >= 1.0:
        return w / w.sum()
    # rank order: value descending, id ascending; only the first ``keep`` ranks are needed
    order = rank_order(x, keep)
    ws = w[order]
    if top_p < 1.0:
        cum = torch.cumsum(ws[:keep], 0)
        target = float(top_p) * float(cum[-1])
        hit = torch.nonzero(cum >= target)
        keep = int(hit[0]) + 1 if hit.numel() else keep
    p = torch.zeros(V, dtype=torch.float64)
    p[order[:keep]] = ws[:keep]
    return p / p.sum()


def rank_order(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the ``k`` largest entries along the last dim of ``x`` (``[V]`` or ``[n, V]``),
    by value descending and id ascending on ties; ``[k]`` or ``[n, k]`` int64 (``k`` capped at
    ``V``). The same as ``torch.sort(-x, stable=True).indices[..., :k]``, but sorts only the
    entries ``>= the k-th largest value`` (every one of the k is among them) instead of all V."""
    V = x.shape[-1]
    if k <= 0:
        return torch.zeros((*x.shape[:-1], 0), dtype=torch.long)
    if k >= V or bool(torch.isnan(x).any()):  # NaN: the threshold test below would drop rows
        return torch.sort(-x, dim=-1, stable=True).indices[..., :k]
    thr = torch.topk(x, k, dim=-1).values[..., -1:]
    c = int((x >= thr).sum(-1).max())  # candidates of the row with the most ties at thr
    vals, ids = torch.topk(x, c, dim=-1)  # holds every candidate, in no tie order
    ids, perm = torch.sort(ids, dim=-1)  # ids ascending ...
    vals = vals.gather(-1, perm)
    return ids.gather(-1, torch.sort(-vals, dim=-1, stable=True).indices[..., :k])  # ... kept


def _children(parents: list[int], n: int, node: int) -> list[int]:
    return [j for j in range(1, n) if parents[j] == node]


def _finish(
    tree, logits, b: int, path: list[int], bonus: int, lp_dist, stop_ids, max_new_tokens
) -> tuple[list[int], int, list[float]]:
    """Apply the budget and stop ids to the walk (path, bonus); return (path, bonus, logprobs)."""
    tok = tree.tokens[b].tolist()
    emitted = [tok[a] for a in path[1:]] + [bonus]
    L = len(emitted)
    cut = L
    if max_new_tokens is not None:
        cut = min(cut, max(1, int(max_new_tokens[b])))
    if stop_ids is not None:
        row = stop_ids if stop_ids.dim() == 1 else stop_ids[b]
        stops = {int(s) for s in row.tolist() if int(s) >= 0}
        for j in range(cut):
            if emitted[j] in stops:
                cut = j + 1
                break
    lps = [float(lp_dist(path[q])[emitted[q]]) for q in range(cut)]
    return path[:cut], emitted[cut - 1], lps


def _emit(tree, logits, results, return_logprobs: bool, topk_ids: int) -> Acceptance:
    B, N = tree.parents.shape
    accepted = torch.full((B, N), -1, dtype=torch.int32)
    accept_len = torch.zeros(B, dtype=torch.int32)
    bonus = torch.full((B,), -1, dtype=torch.int64)
    logprobs = torch.zeros(B, N, dtype=torch.float32) if return_logprobs else None
    for b, res in enumerate(results):
        if res is None:
            continue
        path, bon, lps = res
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path)
        bonus[b] = bon
        if logprobs is not None:
            logprobs[b, : len(lps)] = torch.tensor(lps, dtype=torch.float64).float()
    topk = None
    if topk_ids:
        topk = torch.full((B, N, topk_ids), -1, dtype=torch.int32)
        for b in range(B):
            n = int(tree.num_nodes[b])
            if n:
                ids = rank_order(logits[b, :n].to(torch.float64), topk_ids)
                topk[b, :n, : ids.shape[1]] = ids.to(torch.int32)
    dev = tree.device
    return Acceptance(
        accepted.to(dev),
        accept_len.to(dev),
        bonus.to(dev),
        None if logprobs is None else logprobs.to(dev),
        None if topk is None else topk.to(dev),
    )


def _copy_out(res: Acceptance, out: Acceptance | None) -> Acceptance:
    if out is None:
        return res
    for name in Acceptance._fields:
        src, dst = getattr(res, name), getattr(out, name)
        if src is not None:
            dst.copy_(src)
    return out


def accept_greedy(
    tree,
    target_logits,
    *,
    stop_ids=None,
    max_new_tokens=None,
    return_logprobs=False,
    topk_ids=0,
    out=None,
    validate=False,
) -> Acceptance:
    """Greedy acceptance: from the root follow the child whose token is the argmax of the
    target's logits at the current node (ties: lowest id); bonus = argmax at the last accepted
    node. ``logprobs`` are ``log_softmax(logits)`` (temperature 1) of the emitted tokens."""
    check_accept_inputs(
        tree,
        target_logits,
        stop_ids,
        max_new_tokens,
        topk_ids,
        out,
        return_logprobs,
        validate=validate,
    )
    t = tree.to("cpu")
    lg = target_logits.detach().to("cpu", torch.float64)
    B, N = t.parents.shape
    results = []
    for b in range(B):
        n = int(t.num_nodes[b])
        if n == 0:
            results.append(None)
            continue
        par, tok = t.parents[b].tolist(), t.tokens[b].tolist()
        path = [0]
        while True:
            am = int(torch.argmax(lg[b, path[-1]]))
            nxt = [j for j in _children(par, n, path[-1]) if tok[j] == am]
            if not nxt:
                break
            path.append(nxt[0])
        bonus = int(torch.argmax(lg[b, path[-1]]))

        def lp_dist(i, b=b):
            return torch.log_softmax(lg[b, i], 0)

        results.append(
            _finish(
                t,
                lg,
                b,
                path,
                bonus,
                lp_dist,
                None if stop_ids is None else stop_ids.cpu(),
                None if max_new_tokens is None else max_new_tokens.cpu(),
            )
        )
    return _copy_out(_emit(t, lg, results, return_logprobs, topk_ids), out)


def accept_sample(
    tree,
    target_logits,
    temperature,
    top_k,
    top_p,
    uniforms,
    *,
    stop_ids=None,
    max_new_tokens=None,
    return_logprobs=False,
    topk_ids=0,
    out=None,
    validate=False,
) -> Acceptance:
    """Lossless sampling acceptance, docs/design.md op 7's interval rule.

    At the current node ``i`` (target distribution ``p_i = target_probs(...)``) the interval
    [0, 1) is laid out as the children's probabilities in sibling order (a token repeated among
    siblings counted once, at its first sibling), then every other token in id order.
    ``uniforms[b, i]`` falls in one piece: a child's piece accepts that child and the walk
    continues there; another token's piece makes it the bonus and the walk stops. If rounding
    leaves ``u`` past the end, the last piece of positive length is taken. Rows with
    ``temperature = 0`` are greedy. ``logprobs`` are ``log p_i`` of the emitted tokens (for
    ``T = 0`` rows, ``log_softmax(logits)``). ``top_k`` / ``top_p`` None: off for every request.
    """
    check_accept_inputs(
        tree,
        target_logits,
        stop_ids,
        max_new_tokens,
        topk_ids,
        out,
        return_logprobs,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        uniforms=uniforms,
        validate=validate,
    )
    t = tree.to("cpu")
    lg = target_logits.detach().to("cpu", torch.float64)
    temp = temperature.detach().cpu().to(torch.float64).tolist()
    B, N = t.parents.shape
    # None: top-k (top-p) off for every request
    tk = [0] * B if top_k is None else top_k.detach().cpu().tolist()
    tp = [1.0] * B if top_p is None else top_p.detach().cpu().to(torch.float64).tolist()
    uni = uniforms.detach().cpu().to(torch.float64)
    results = []
    for b in range(B):
        n = int(t.num_nodes[b])
        if n == 0:
            results.append(None)
            continue
        par, tok = t.parents[b].tolist(), t.tokens[b].tolist()
        cache: dict[int, torch.Tensor] = {}

        def probs(i, b=b, cache=cache):
            if i not in cache:
                cache[i] = target_probs(lg[b, i], temp[b], int(tk[b]), tp[b])
            return cache[i]

        path = [0]
        bonus = -1
        for _ in range(N + 1):
            cur = path[-1]
            p = probs(cur)
            u = float(uni[b, cur])
            kids, seen = [], set()
            for j in _children(par, n, cur):
                if tok[j] not in seen:
                    seen.add(tok[j])
                    kids.append(j)
            acc = 0.0
            chosen = -1
            last_kid = -1
            for j in kids:
                q = float(p[tok[j]])
                if q > 0:
                    last_kid = j
                acc += q
                if q > 0 and u < acc:
                    chosen = j
                    break
            if chosen < 0:
                rest = p.clone()
                for j in kids:
                    rest[tok[j]] = 0.0
                cum = acc + torch.cumsum(rest, 0)
                hit = torch.nonzero((cum > u) & (rest > 0))
                if hit.numel():
                    bonus = int(hit[0])
                else:
                    pos = torch.nonzero(rest > 0)
                    if pos.numel():
                        bonus = int(pos[-1])
                    else:
                        chosen = last_kid
            if chosen >= 0:
                path.append(chosen)
                continue
            break

        def lp_dist(i, b=b):
            return torch.log(probs(i)) if temp[b] > 0 else torch.log_softmax(lg[b, i], 0)

        results.append(
            _finish(
                t,
                lg,
                b,
                path,
                bonus,
                lp_dist,
                None if stop_ids is None else stop_ids.cpu(),
                None if max_new_tokens is None else max_new_tokens.cpu(),
            )
        )
    return _copy_out(_emit(t, lg, results, return_logprobs, topk_ids), out)
