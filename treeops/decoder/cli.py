"""``treeops decode``: the example decoder on a tiny random pair (CPU), every policy, checked
against plain greedy decoding. Weights from a local directory with ``--model`` (needs
``safetensors`` for safetensors files; the draft is then the target's bigram approximation,
untrained)."""

from __future__ import annotations

import json
import time

import torch

from .engine import Decoder
from .model import Draft, ModelConfig, Target, reference_forward
from .policies import POLICIES, make_policy
from .results import SamplingParams

__all__ = ["load_model", "run_decode"]


def load_model(path: str) -> Target:
    """``Target.from_pretrained(path)``; a ``ValueError`` (one line, the cause) if it fails."""
    try:
        return Target.from_pretrained(path)
    except (OSError, ImportError, ValueError, KeyError, RuntimeError, json.JSONDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"cannot load a model from {path!r}: {msg}") from e


def run_decode(
    batch: int = 3,
    new_tokens: int = 16,
    policies: list[str] | None = None,
    seed: int = 0,
    temperature: float = 0.0,
    model: str | Target | None = None,
) -> int:
    """Decode ``batch`` random prompts with each of ``policies`` (default: every policy), print
    a table and, at temperature 0, whether each output equals greedy decoding. ``model``: a
    local directory or a loaded ``Target`` (default: a tiny random target). Returns 0, or 1 if
    a policy's greedy output differs. Bad arguments raise ``ValueError`` before any work."""
    if batch < 1:
        raise ValueError(f"Invalid batch: expected >= 1, got {batch}")
    if new_tokens < 1:
        raise ValueError(f"Invalid new_tokens: expected >= 1, got {new_tokens}")
    names = list(policies or POLICIES)
    bad = [p for p in names if p not in POLICIES]
    if bad:
        raise ValueError(f"Invalid policy: expected one of {POLICIES}, got {bad[0]!r}")
    samp = SamplingParams(temperature=temperature)
    torch.manual_seed(seed)
    if model is not None:
        target = load_model(model) if isinstance(model, str) else model
        cfg = target.cfg
    else:
        cfg = ModelConfig(tie_word_embeddings=False)
        target = Target(cfg, seed=seed)
        with torch.no_grad():  # a target close to its bigram part: the untrained draft accepts
            for layer in target.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.1)
                layer.mlp.down_proj.weight.mul_(0.1)
    draft = Draft(cfg, seed=seed + 1).bigram_init(target)
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, cfg.vocab_size, (4 + 3 * b,), generator=g).tolist() for b in range(batch)
    ]
    print(
        f"treeops decode: B={batch}, {new_tokens} new tokens, vocab {cfg.vocab_size}, "
        f"{cfg.num_hidden_layers} layers, T={temperature}"
    )
    print(f"{'policy':<15}{'steps':>6}{'acc/step':>10}{'tok/s':>9}{'draft s':>9}{'ops s':>8}"
          f"{'verify s':>9}  same as greedy")  # fmt: skip
    ref = None
    if temperature <= 0:  # plain greedy decoding: full recompute, causal mask, no treeops
        ref = []
        with torch.no_grad():
            for p in prompts:
                toks = list(p)
                for _ in range(new_tokens):
                    toks.append(int(reference_forward(target, torch.tensor(toks))[-1].argmax()))
                ref.append(toks[len(p) :])
    ok = True
    last: list[list[int]] = []
    for name in names:
        dec = Decoder(target, draft, make_policy(name, depth=4, topk=4, budget=16))
        t0 = time.perf_counter()
        res = dec.generate(
            prompts, new_tokens, sampling=samp, generator=torch.Generator().manual_seed(seed)
        )
        dt = time.perf_counter() - t0
        same = "-" if ref is None else str(res.tokens == ref)
        ok &= same != "False"
        ntok = sum(len(t) for t in res.tokens)
        print(
            f"{name:<15}{res.steps:>6}{res.mean_accepted:>10.2f}{ntok / dt:>9.1f}"
            f"{res.time_draft:>9.3f}{res.time_tree:>8.3f}{res.time_verify:>9.3f}  {same}"
        )
        last = res.tokens
    print(f"\nrequest 0: {prompts[0]} -> {last[0]}")
    return 0 if ok else 1
