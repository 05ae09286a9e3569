"""The batch of draft trees every treeops op reads or writes.

A ``Tree`` is padded to a fixed capacity of ``N`` nodes per request (root included) so that shapes
never change between decoding steps and every op can be captured in a CUDA graph.

| field | shape, dtype | meaning; padding value |
| --- | --- | --- |
| ``tokens`` | [B, N] int64 | token id of each node; 0 |
| ``parents`` | [B, N] int32 | parent index, -1 for the root; -1 |
| ``num_nodes`` | [B] int32 | valid nodes per request (>= 1 active, 0 inactive row) |
| ``depth`` | [B, N] int32 | root = 0; 0 |
| ``anc`` | [B, N, W] int32, W = ceil(N/32) | bit j%32 of word j//32 of row i set iff node j is an
  ancestor of i or i itself; 0 |
| ``first_child``, ``next_sibling`` | [B, N] int32 | sibling lists in increasing index; -1 |
| ``scores`` | [B, N] float32 | path confidence (root = 1, grafted nodes 0); 0 |

Nodes are in rank order (``parents[i] < i``); node 0 is the root, the last accepted token, whose
K/V is not yet in the cache. Node i's K/V sits at cache slot ``seq_lens[b] + i``; its position is
``seq_lens[b] + depth[i]`` (``Tree.positions``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ._checks import Memo, check_same_device, check_tensor, signature


def anc_words(n: int) -> int:
    """Number of int32 words of an ``anc`` row for capacity ``n``: ceil(n / 32)."""
    return (n + 31) // 32


def bit_value(j: int) -> int:
    """The int32 value of bit ``j % 32`` (bit 31 is the sign bit: -2**31)."""
    s = j % 32
    return -(1 << 31) if s == 31 else 1 << s


@dataclass
class Tree:
    """A batch of padded draft trees (see the module docstring for the fields)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    depth: torch.Tensor
    anc: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    scores: torch.Tensor

    # not annotated: a class constant, not a dataclass field
    FIELDS = (
        "tokens",
        "parents",
        "num_nodes",
        "depth",
        "anc",
        "first_child",
        "next_sibling",
        "scores",
    )
    """The field names in declaration order: the order of ``tensors()`` and of the custom ops'
    tree arguments."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields as a tuple, in ``FIELDS`` order (``Tree(*tree.tensors())`` rebuilds it)."""
        return (
            self.tokens,
            self.parents,
            self.num_nodes,
            self.depth,
            self.anc,
            self.first_child,
            self.next_sibling,
            self.scores,
        )

    # ---------------------------------------------------------------- shape
    @property
    def batch_size(self) -> int:
        return int(self.parents.shape[0])

    @property
    def capacity(self) -> int:
        """N, the node capacity per request (root included)."""
        return int(self.parents.shape[1])

    @property
    def device(self) -> torch.device:
        return self.parents.device

    # ---------------------------------------------------------- construction
    @staticmethod
    def from_parents(
        parents: torch.Tensor,
        num_nodes: torch.Tensor,
        tokens: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
    ) -> Tree:
        """Build a tree from parent indices, computing ``depth``, ``anc`` and the sibling links.

        Args:
            parents: [B, N] int32, ``parents[b, 0] = -1``, ``parents[b, i] < i`` for
                ``0 < i < num_nodes[b]``; entries at ``i >= num_nodes[b]`` are ignored.
            num_nodes: [B] int32, valid nodes per request (0 = inactive row).
            tokens: [B, N] int64 (default zeros).
            scores: [B, N] float32 (default 1 for every valid node).

        Runs on the tensors' device without a host sync, in O(log N) rounds of batched gathers
        (pointer doubling: after round k every node has merged the ancestor bits and the depth
        of its 2**k nearest ancestors), a fixed number of device ops whatever the tree; padding
        slots are set to the padding values. Call ``validate()`` to check the input was well
        formed (``depth``/``anc`` of a malformed one are unspecified).

        Example:
            >>> import torch, treeops
            >>> t = treeops.Tree.from_parents(torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32),
            ...                               torch.tensor([4], dtype=torch.int32))
            >>> t.depth.tolist(), t.anc[0, 3].tolist()
            ([[0, 1, 1, 2]], [11])
        """
        sizes: dict[str, int] = {}
        check_tensor("parents", parents, shape=("B", "N"), dtype=torch.int32, sizes=sizes)
        check_tensor("num_nodes", num_nodes, shape=("B",), dtype=torch.int32, sizes=sizes)
        if tokens is not None:
            check_tensor("tokens", tokens, shape=("B", "N"), dtype=torch.int64, sizes=sizes)
        if scores is not None:
            check_tensor("scores", scores, shape=("B", "N"), dtype=torch.float32, sizes=sizes)
        dev = check_same_device(parents=parents, num_nodes=num_nodes, tokens=tokens, scores=scores)
        B, N = parents.shape
        W = anc_words(N)
        idx = torch.arange(N, device=dev, dtype=torch.int32)
        valid = idx[None, :] < num_nodes[:, None]  # [B, N]
        par = torch.where(valid & (idx[None, :] > 0), parents, -1)
        # jump[b, i]: the farthest ancestor merged so far; a node without a parent (the root, a
        # padding slot) points at itself, so merging it again changes nothing
        has_parent = (par >= 0) & (par < N)
        jump = torch.where(has_parent, par, idx[None, :]).long()
        depth = has_parent.to(torch.int32)
        anc = torch.where(valid[:, :, None], _self_bits(N, dev)[None], 0)  # [B, N, W]
        for _ in range(max(N - 1, 0).bit_length()):  # 2**rounds >= N > any depth
            anc = anc | anc.gather(1, jump[:, :, None].expand(B, N, W))
            depth = depth + depth.gather(1, jump)
            jump = jump.gather(1, jump)
        first_child, next_sibling = _links(par, valid)
        tok = torch.zeros(B, N, dtype=torch.int64, device=dev) if tokens is None else tokens
        sc = torch.ones(B, N, dtype=torch.float32, device=dev) if scores is None else scores
        return Tree(
            tokens=torch.where(valid, tok, 0),
            parents=par,
            num_nodes=num_nodes.clone(),
            depth=depth,
            anc=anc,
            first_child=first_child,
            next_sibling=next_sibling,
            scores=torch.where(valid, sc, 0.0),
        )

    @staticmethod
    def uninitialized(batch_size: int, capacity: int, device: torch.device | str = "cpu") -> Tree:
        """Output buffers for an op that writes every element (``torch.empty``, no fill)."""
        B, N = batch_size, capacity
        i32 = dict(dtype=torch.int32, device=device)
        return Tree(
            tokens=torch.empty(B, N, dtype=torch.int64, device=device),
            parents=torch.empty(B, N, **i32),
            num_nodes=torch.empty(B, **i32),
            depth=torch.empty(B, N, **i32),
            anc=torch.empty(B, N, anc_words(N), **i32),
            first_child=torch.empty(B, N, **i32),
            next_sibling=torch.empty(B, N, **i32),
            scores=torch.empty(B, N, dtype=torch.float32, device=device),
        )

    @staticmethod
    def empty(batch_size: int, capacity: int, device: torch.device | str = "cpu") -> Tree:
        """A tree with every row inactive (``num_nodes = 0``), all padding values."""
        B, N = batch_size, capacity
        neg = torch.full((B, N), -1, dtype=torch.int32, device=device)
        return Tree(
            tokens=torch.zeros(B, N, dtype=torch.int64, device=device),
            parents=neg.clone(),
            num_nodes=torch.zeros(B, dtype=torch.int32, device=device),
            depth=torch.zeros(B, N, dtype=torch.int32, device=device),
            anc=torch.zeros(B, N, anc_words(N), dtype=torch.int32, device=device),
            first_child=neg.clone(),
            next_sibling=neg.clone(),
            scores=torch.zeros(B, N, dtype=torch.float32, device=device),
        )

    # ------------------------------------------------------------- utilities
    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """RoPE positions ``seq_lens[b] + depth[b, i]``, [B, N] int64 (padding: ``seq_lens[b]``)."""
        check_tensor(
            "seq_lens", seq_lens, shape=(self.batch_size,), dtype=(torch.int32, torch.int64)
        )
        check_same_device(tree=self.parents, seq_lens=seq_lens)
        return seq_lens.to(torch.int64)[:, None] + self.depth.to(torch.int64)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Tree:
        return Tree(
            **{
                f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                for f in fields(self)
            }
        )

    def clone(self) -> Tree:
        return Tree(**{f.name: getattr(self, f.name).clone() for f in fields(self)})

    def ancestor_mask(self) -> torch.Tensor:
        """[B, N, N] bool: ``[b, i, j]`` iff node j is an ancestor-or-self of node i (from anc)."""
        N = self.capacity
        j = torch.arange(N, device=self.device)
        words = self.anc[:, :, j // 32].to(torch.int64) & 0xFFFFFFFF  # [B, N, N]
        return ((words >> (j % 32)) & 1).bool()

    def check_fields(self, name: str = "tree") -> None:
        """Shapes, dtypes, strides and devices of the fields (no host sync).

        Every field must be contiguous (``treeops._checks.check_stride``): the kernels index
        them densely (``b * N + i``), so a strided view would be read (or written) wrongly.
        ``name``: the argument named in errors (``tree.tokens``, ``out.tokens``, ...)."""
        sizes: dict[str, int] = {}
        check_tensor(f"{name}.parents", self.parents, shape=("B", "N"), dtype=torch.int32,
                     sizes=sizes, contiguous=True)  # fmt: skip
        layout = (
            ("tokens", ("B", "N"), torch.int64),
            ("num_nodes", ("B",), torch.int32),
            ("depth", ("B", "N"), torch.int32),
            ("anc", ("B", "N", anc_words(sizes["N"])), torch.int32),
            ("first_child", ("B", "N"), torch.int32),
            ("next_sibling", ("B", "N"), torch.int32),
            ("scores", ("B", "N"), torch.float32),
        )
        for field_name, shape, dtype in layout:
            check_tensor(f"{name}.{field_name}", getattr(self, field_name), shape=shape,
                         dtype=dtype, sizes=sizes, contiguous=True)  # fmt: skip
        check_same_device(**{f"{name}.{f.name}": getattr(self, f.name) for f in fields(self)})

    def validate(self) -> None:
        """Check every invariant on the host; raise ``ValueError`` naming the first one violated.

        Checks field shapes/dtypes/devices, ``0 <= num_nodes <= N``, the root, ``parents[i] < i``,
        ``depth``, ``anc`` (exact ancestor closure), the sibling links, distinct sibling tokens,
        scores finite, in [0, 1], root = 1, non-increasing with index (rank order; grafted nodes
        score 0 after the draft nodes) and so never increasing from parent to child, and the
        padding values.
        """
        self.check_fields()
        t = self.to("cpu")
        B, N = t.parents.shape
        for b in range(B):
            n = int(t.num_nodes[b])
            if not 0 <= n <= N:
                raise ValueError(f"Invalid tree: num_nodes[{b}] = {n} not in [0, {N}]")
            par = t.parents[b].tolist()
            dep = t.depth[b].tolist()
            tok = t.tokens[b].tolist()
            sc = t.scores[b].tolist()
            if n >= 1 and par[0] != -1:
                raise ValueError(f"Invalid tree: request {b}: root parent is {par[0]}, expected -1")
            for i in range(1, n):
                if not 0 <= par[i] < i:
                    raise ValueError(
                        f"Invalid tree: request {b}: parents[{i}] = {par[i]}, expected 0 <= p < {i}"
                    )
            for i in range(n):
                want = 0 if i == 0 else dep[par[i]] + 1
                if dep[i] != want:
                    raise ValueError(
                        f"Invalid tree: request {b}: depth[{i}] = {dep[i]}, expected {want}"
                    )
            for i in range(n):
                s = sc[i]
                if not (s == s and 0.0 <= s <= 1.0):
                    raise ValueError(
                        f"Invalid tree: request {b}: scores[{i}] = {s}, expected a number in [0, 1]"
                    )
            if n >= 1 and sc[0] != 1.0:
                raise ValueError(
                    f"Invalid tree: request {b}: scores[0] = {sc[0]}, expected 1 (the root)"
                )
            for i in range(1, n):
                if sc[i] > sc[i - 1]:
                    raise ValueError(
                        f"Invalid tree: request {b}: scores[{i}] = {sc[i]} exceeds scores[{i - 1}] "
                        f"= {sc[i - 1]}: nodes must be in rank order (score descending)"
                    )
            # anc: exact ancestor closure
            for i in range(n):
                want_set = set()
                j = i
                while j >= 0:
                    want_set.add(j)
                    j = par[j]
                for w in range(t.anc.shape[2]):
                    word = int(t.anc[b, i, w]) & 0xFFFFFFFF
                    for bit in range(32):
                        node = 32 * w + bit
                        if bool(word >> bit & 1) != (node in want_set):
                            raise ValueError(
                                f"Invalid tree: request {b}: anc[{i}] bit {node} is "
                                f"{word >> bit & 1}, but node {node} is "
                                f"{'' if node in want_set else 'not '}an ancestor-or-self of {i}"
                            )
            # links and distinct sibling tokens
            fc, ns = t.first_child[b].tolist(), t.next_sibling[b].tolist()
            for p in range(n):
                kids = [i for i in range(1, n) if par[i] == p]
                want_fc = kids[0] if kids else -1
                if fc[p] != want_fc:
                    raise ValueError(
                        f"Invalid tree: request {b}: first_child[{p}] = {fc[p]}, expected {want_fc}"
                    )
                for a, c in zip(kids, kids[1:] + [-1]):
                    if ns[a] != c:
                        raise ValueError(
                            f"Invalid tree: request {b}: next_sibling[{a}] = {ns[a]}, expected {c}"
                        )
                seen: dict[int, int] = {}
                for k in kids:
                    if tok[k] in seen:
                        raise ValueError(
                            f"Invalid tree: request {b}: siblings {seen[tok[k]]} and {k} both "
                            f"carry token {tok[k]}"
                        )
                    seen[tok[k]] = k
            if n >= 1 and ns[0] != -1:
                raise ValueError(
                    f"Invalid tree: request {b}: next_sibling[0] = {ns[0]}, expected -1"
                )
            # padding
            pads = {
                "tokens": 0,
                "parents": -1,
                "depth": 0,
                "first_child": -1,
                "next_sibling": -1,
                "scores": 0.0,
            }
            for name, val in pads.items():
                row = getattr(t, name)[b, n:]
                if bool((row != val).any()):
                    raise ValueError(
                        f"Invalid tree: request {b}: padding of {name} at nodes >= {n} "
                        f"must be {val}"
                    )
            if bool((t.anc[b, n:] != 0).any()):
                raise ValueError(
                    f"Invalid tree: request {b}: padding of anc at nodes >= {n} must be 0"
                )

    def draw(self, b: int = 0, vocab: list[str] | None = None) -> str:
        """A text drawing of request ``b``'s tree: one line per node, indented by depth."""
        t = self.to("cpu")
        n = int(t.num_nodes[b])
        if n == 0:
            return f"request {b}: inactive"
        lines = [f"request {b}: {n} nodes"]

        def label(i: int) -> str:
            tok = int(t.tokens[b, i])
            name = repr(vocab[tok]) if vocab is not None and 0 <= tok < len(vocab) else str(tok)
            return f"[{i}] {name}  score={float(t.scores[b, i]):.3g}"

        def walk(i: int, prefix: str, last: bool, root: bool) -> None:
            if root:
                lines.append(label(i))
                child_prefix = ""
            else:
                lines.append(prefix + ("└─ " if last else "├─ ") + label(i))
                child_prefix = prefix + ("   " if last else "│  ")
            kids = []
            c = int(t.first_child[b, i])
            for _ in range(n):
                if c < 0 or c >= n:
                    break
                kids.append(c)
                c = int(t.next_sibling[b, c])
            for k, c in enumerate(kids):
                walk(c, child_prefix, k == len(kids) - 1, False)

        walk(0, "", True, True)
        return "\n".join(lines)


def _self_bits(n: int, device: torch.device) -> torch.Tensor:
    """[n, anc_words(n)] int32: row i holds node i's own bit (``bit_value(i)`` in word i // 32)."""
    idx = torch.arange(n, device=device)
    word = torch.arange(anc_words(n), device=device)
    bit = torch.ones((), dtype=torch.int64, device=device) << (idx % 32)
    bit = torch.where(bit >= 1 << 31, bit - (1 << 32), bit).to(torch.int32)  # bit 31 = -2**31
    return torch.where((idx // 32)[:, None] == word[None, :], bit[:, None], 0)


def _links(par: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """first_child / next_sibling (increasing index) from masked parents, vectorised."""
    B, N = par.shape
    dev = par.device
    idx = torch.arange(N, device=dev)
    big = torch.full((B, N, N), N, dtype=torch.int64, device=dev)
    # child_of[b, p, j]: j is a valid child of p
    child_of = (par[:, None, :] == idx[None, :, None]) & valid[:, None, :]
    fc = torch.where(child_of, idx[None, None, :].expand(B, N, N), big).min(dim=2).values
    first_child = torch.where(fc < N, fc, -1).to(torch.int32)
    # sib[b, i, j]: j > i shares i's parent
    sib = (
        (par[:, :, None] == par[:, None, :])
        & (par[:, :, None] >= 0)
        & valid[:, :, None]
        & valid[:, None, :]
        & (idx[None, None, :] > idx[None, :, None])
    )
    nx = torch.where(sib, idx[None, None, :].expand(B, N, N), big).min(dim=2).values
    next_sibling = torch.where(nx < N, nx, -1).to(torch.int32)
    first_child = torch.where(valid, first_child, -1)
    return first_child, next_sibling


_PASSED = Memo()
"""Field signatures of trees whose ``check_fields`` passed (the check is the same whatever
``name`` it reports under)."""


def tree_signature(tree: object) -> tuple | None:
    """``signature`` of a ``Tree``'s fields (None if ``tree`` is not exactly a ``Tree``): what
    ``Tree.check_fields`` reads, for a public op's memo of passed checks."""
    if not isinstance(tree, Tree):
        return None
    return signature(tree.tensors())  # type: ignore[union-attr]


def check_tree(tree: object, *, validate: bool = False, name: str = "tree") -> Tree:
    """Public-op helper: ``tree`` is a ``Tree`` with consistent fields (and, if asked, valid).
    Field layouts that passed once are remembered (``_PASSED``); ``validate`` always runs."""
    if not isinstance(tree, Tree):
        raise ValueError(
            f"Invalid type of {name}: expected treeops.Tree, got {type(tree).__name__}"
        )
    key = tree_signature(tree)
    if _PASSED.get(key) is None:
        tree.check_fields(name)
        _PASSED.put(key, True)
    if validate:
        tree.validate()
    return tree
