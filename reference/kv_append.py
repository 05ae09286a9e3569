"""Reference KV append with RoPE: the specification of ``treeops.kv_append``.

Token i < ``num_tokens[b]`` of request b goes to logical cache slot ``seq_lens[b] + i`` (page
``block_table[b, slot // page_size]``, row ``slot % page_size``): V as given, K rotated by RoPE
at position ``seq_lens[b] + depth[b, i]`` (``depth=None``: position ``seq_lens[b] + i``, the
prefill / chain case). With ``q`` [B, N, H_q, D], its rows i < ``num_tokens[b]`` are rotated in
place at the same positions (rows beyond are left as they are). RoPE is Llama's as Hugging Face
writes it (``rotate_half``: the first and second halves of the head dimension form the pairs),
``inv_freq[k] = theta^(-2k/D)`` in fp32, the angle ``position · inv_freq`` in fp32. Nothing else
in the caches changes.
"""

from __future__ import annotations

import torch


def rope_inv_freq(d: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[D/2] fp32 ``1 / theta^(2k/D)``, computed exactly as Hugging Face Llama does."""
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` [..., H, D] by RoPE at integer ``positions`` [...]; fp32 math, x's dtype."""
    d = x.shape[-1]
    ang = positions.to(torch.float32)[..., None] * rope_inv_freq(d, theta, x.device)  # [..., D/2]
    cos = torch.cos(ang)[..., None, :]  # [..., 1, D/2]
    sin = torch.sin(ang)[..., None, :]
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def kv_append(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: torch.Tensor,
    depth: torch.Tensor | None = None,
    *,
    q: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    validate: bool = False,
) -> None:
    """Same contract as ``treeops.kv_append`` (in place, ``q`` too); ``validate`` is ignored."""
    B, N = k.shape[:2]
    page_size = k_cache.shape[1]
    for b in range(B):
        s = int(seq_lens[b])
        n = min(int(num_tokens[b]), N)
        if n <= 0:
            continue
        i = torch.arange(n, device=k.device)
        pos = s + (i if depth is None else depth[b, :n].long())
        slot = s + i
        page = block_table[b, slot // page_size].long()
        k_cache[page, slot % page_size] = rope(k[b, :n], pos, rope_theta).to(k_cache.dtype)
        v_cache[page, slot % page_size] = v[b, :n].to(v_cache.dtype)
        if q is not None:
            q[b, :n] = rope(q[b, :n], pos, rope_theta)
