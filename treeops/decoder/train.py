"""Train the example decoder's own target/draft pair on real Python source (no downloads).

No pretrained weights can be fetched on the machines this project runs on, so the pair is trained
here, on the machine it runs on, from the Python source it already holds:

* ``python_sources`` (``data.py``): the ``.py`` files of the interpreter's standard library and
  installed packages (``sysconfig`` paths), deduplicated by content, shuffled by a seed and split
  **by module** into training and held-out files.
* ``train_tokenizer`` (``data.py``): a byte-level BPE tokenizer (the ``tokenizers`` library,
  ``pip install treeops[demo]``); ``encode_stream`` encodes with ``encode_batch`` (all cores)
  into one token stream, files separated by ``<|endoftext|>`` (id 0, the model's
  ``eos_token_id``).
* ``train_target``: the Llama-style ``Target`` trained by next-token cross-entropy on random
  windows of the stream, through its training forward (``Target.forward_train``: whole sequences,
  causal SDPA, no cache), for a wall-clock budget; bf16 autocast and ``torch.compile`` (with an
  eager fallback) on CUDA.
* ``train_draft``: the EAGLE-style ``Draft`` trained on the frozen target's *features* (its final
  normed hidden state, what ``Target.forward`` hands the draft): at position t the draft sees
  (token t, target feature at t-1) and learns (a) the target's next-token distribution at t (soft
  cross-entropy, i.e. distillation: acceptance asks for agreement with the target, not with the
  data) and (b) the target's feature at t (smooth-L1 regression, EAGLE-1), because the decoder
  feeds a drafted node's children the draft's own output hidden in place of that feature. A
  second unrolled pass feeds the draft its own shifted outputs as features (EAGLE-3's
  "training-time test", approximated with a plain causal mask) so that depth >= 2 proposals are
  trained on the inputs they get when drafting.
* ``train_pair``: all of it, with held-out evaluation (target loss and top-1 accuracy; draft top-1
  agreement with the target) and a cache directory.

Presets: ``PairConfig.tiny()`` trains in about a minute on two CPU cores (the ``treeops demo``
pair); ``PairConfig.h200()`` is a 24-layer, ~110M-parameter target for one large GPU (the
end-to-end benchmark, ``bench/bench_e2e.py``).

Example (CPU, a few seconds)::

    from treeops.decoder.train import PairConfig, train_pair
    pair = train_pair(PairConfig.micro(), "cpu")
    print(pair.report["heldout_loss"], pair.tokenizer.decode(pair.prompts[0]))
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .data import EOS, encode_stream, heldout_prompts, python_sources, train_tokenizer
from .model import Draft, ModelConfig, Target

if TYPE_CHECKING:  # optional dependency (the ``demo`` extra)
    from tokenizers import Tokenizer

__all__ = [
    "EOS",
    "PairConfig",
    "TrainedPair",
    "python_sources",
    "train_tokenizer",
    "encode_stream",
    "train_target",
    "train_draft",
    "evaluate_target",
    "evaluate_draft",
    "heldout_prompts",
    "train_pair",
    "load_pair",
]

_FORMAT = 2  # bump when the cached files' meaning changes (2: the split groups module copies)

Progress = Callable[[str, float, str], None]
"""``progress(phase, fraction_done, info)``: called often during training (phase ``"target"`` or
``"draft"``); the demo draws a progress bar with it."""


# -------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class PairConfig:
    """Everything that determines a trained pair (the cache key): data, tokenizer, model shape,
    optimisation and evaluation. The draft is one decoder layer of the target's shape."""

    name: str = "tiny"
    # data
    data_bytes: int = 4_000_000  # Python source read (train + held-out)
    tokenizer_bytes: int = 2_000_000  # of the training text, what the BPE trainer sees
    heldout_fraction: float = 0.05
    max_file_bytes: int = 1 << 18
    # target shape (Llama; head_dim 64 for treeops' kernels)
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 4
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 64
    # optimisation
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    draft_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    target_seconds: float = 45.0  # wall-clock budgets (compilation excluded)
    draft_seconds: float = 20.0
    max_steps: int | None = None  # per model: stops there (the learning-rate schedule then
    # follows the step count, so two machines train the same pair) unless the budget ends first
    draft_reg_weight: float = 1.0  # feature regression beside the distillation loss
    draft_unroll: int = 1  # passes: 1 = target features only, 2 = + the draft's own features
    autocast: str = "none"  # "bf16": bf16 autocast on CUDA (fp32 master weights)
    compile: bool = False  # torch.compile the training step (CUDA; eager on failure)
    threads: int | None = None  # CPU threads while training (None: 1 on a busy machine, else all)
    # evaluation
    eval_tokens: int = 16_384
    num_prompts: int = 16
    prompt_len: int = 32
    seed: int = 0

    @classmethod
    def tiny(cls) -> PairConfig:
        """CPU: a 4-layer, d = 64 target (~0.25M parameters, vocab 512) and its draft, trained
        fp32 for 45 s + 20 s (one draft pass: more steps); the ``treeops demo`` pair. Small
        because a CPU trains few tokens in that budget, and on few tokens a smaller model (and
        vocabulary) reaches a lower loss."""
        return cls()

    @classmethod
    def micro(cls) -> PairConfig:
        """Seconds on a CPU, for tests: 200 KB of source, vocab 320, one layer of d = 64."""
        return cls(
            name="micro", data_bytes=200_000, tokenizer_bytes=100_000, heldout_fraction=0.2,
            vocab_size=320, intermediate_size=128, num_hidden_layers=1, seq_len=64, batch_size=8,
            warmup_steps=2, target_seconds=5.0, draft_seconds=5.0, max_steps=8, eval_tokens=2048,
            num_prompts=4, prompt_len=16,
        )  # fmt: skip

    @classmethod
    def h200(cls) -> PairConfig:
        """One H200: a 24-layer target, d = 640, 10 query / 2 KV heads of 64, SwiGLU 1728, vocab
        8192, tied embeddings (~109M parameters), bf16 autocast + torch.compile; it and the
        one-layer draft train 1,500 steps each (~115 s and ~55 s on an H200; 240 s and 120 s
        are safety caps). Step counts, not wall-clock budgets, so that every machine trains the
        same pair and end-to-end rows from different device calls compare. Data: 100 MB of
        source, the tokenizer trained on 40 MB of it."""
        return cls(
            name="h200", data_bytes=100_000_000, tokenizer_bytes=40_000_000, vocab_size=8192,
            hidden_size=640, intermediate_size=1728, num_hidden_layers=24, num_attention_heads=10,
            num_key_value_heads=2, seq_len=1024, batch_size=32, lr=1.5e-3, draft_lr=2e-3,
            warmup_steps=100, target_seconds=240.0, draft_seconds=120.0, max_steps=1500,
            draft_unroll=2,
            autocast="bf16", compile=True, eval_tokens=1_048_576, num_prompts=64, prompt_len=128,
        )  # fmt: skip

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            tie_word_embeddings=True,
            eos_token_id=0,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PairConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **kw: Any) -> PairConfig:
        return replace(self, **kw)


@dataclass
class TrainedPair:
    """A trained pair: models in fp32 on the training device (cast them for decoding), the
    tokenizer, held-out prompts (token-id lists) and the report (``train_pair`` documents it)."""

    tokenizer: Tokenizer
    target: Target
    draft: Draft
    prompts: list[list[int]]
    report: dict[str, Any]
    config: PairConfig = field(default_factory=PairConfig)


# ------------------------------------------------------------------------------------ training
def _autocast(cfg: PairConfig, device: torch.device):
    enabled = cfg.autocast == "bf16" and device.type == "cuda"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(stream: torch.Tensor, cfg: PairConfig, device: torch.device, seed: int):
    """Endless random windows [B, T + 1] of the stream (int64, on ``device``)."""
    T = cfg.seq_len
    if stream.numel() < T + 2:
        raise ValueError(f"token stream of {stream.numel()} tokens is shorter than seq_len + 2")
    data = stream.to(device)
    g = torch.Generator().manual_seed(seed)
    ar = torch.arange(T + 1, device=device)
    while True:
        starts = torch.randint(0, data.numel() - T - 1, (cfg.batch_size,), generator=g)
        yield data[starts.to(device)[:, None] + ar].long()


def _lr(cfg: PairConfig, peak: float, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return peak * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def _optimizer(params: list[torch.nn.Parameter], lr: float, wd: float, device: torch.device):
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **kw)


def _scale_residual_init(layers, n_layers: int) -> None:
    """GPT-2's init: the projections that write into the residual stream scaled by
    1/sqrt(2 L), so a deep stack starts near the identity."""
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.o_proj.weight.mul_(1 / math.sqrt(2 * n_layers))
            layer.mlp.down_proj.weight.mul_(1 / math.sqrt(2 * n_layers))


def _run(
    phase: str,
    cfg: PairConfig,
    params: list[torch.nn.Parameter],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    batches,
    device: torch.device,
    seconds: float,
    peak_lr: float,
    log: Callable[[str], None],
    progress: Progress | None,
) -> dict[str, Any]:
    """The loop shared by target and draft: AdamW, warm-up then cosine decay over the wall-clock
    budget (or ``max_steps``), gradient clipping. ``loss_fn(batch)`` is compiled first when
    ``cfg.compile`` on CUDA; compilation (the first step) does not count against the budget."""
    opt = _optimizer(params, peak_lr, cfg.weight_decay, device)
    fn = loss_fn
    compiled = False
    if cfg.compile and device.type == "cuda":
        try:
            fn = torch.compile(loss_fn)
            compiled = True
        except Exception as e:  # noqa: BLE001 - any failure: train eager
            log(f"{phase}: torch.compile unavailable ({type(e).__name__}: {e}); eager")

    def step(batch: torch.Tensor, lr: float) -> torch.Tensor:
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss = fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    t_c = time.perf_counter()
    first = next(batches)
    try:
        loss = step(first, _lr(cfg, peak_lr, 0, 0.0))
        _sync(device)
    except Exception as e:  # noqa: BLE001 - a compiler failure shows at the first call
        if not compiled:
            raise
        log(f"{phase}: torch.compile failed ({type(e).__name__}: {e}); eager")
        opt.zero_grad(set_to_none=True)
        fn, compiled = loss_fn, False
        loss = step(first, _lr(cfg, peak_lr, 0, 0.0))
        _sync(device)
    compile_s = time.perf_counter() - t_c
    tokens_per_step = first.shape[0] * (first.shape[1] - 1)
    steps, losses = 1, [float(loss)]
    ema = float(loss)
    t0 = time.perf_counter()
    last_log = t0
    max_steps = cfg.max_steps
    while True:
        elapsed = time.perf_counter() - t0
        frac = elapsed / seconds if seconds > 0 else 1.0
        if max_steps is not None:
            frac = max(frac, steps / max_steps)
        if frac >= 1.0:
            break
        loss = step(next(batches), _lr(cfg, peak_lr, steps, frac))
        steps += 1
        if steps % 10 == 0 or max_steps is not None:
            v = float(loss)  # syncs every 10 steps: the host never runs far ahead of the clock
            losses.append(v)
            ema = 0.9 * ema + 0.1 * v
        if progress is not None:
            progress(phase, frac, f"loss {ema:.3f}")
        now = time.perf_counter()
        if now - last_log >= max(10.0, seconds / 10):
            last_log = now
            log(f"{phase}: {now - t0:6.1f} s, step {steps}, loss {ema:.3f}")
    _sync(device)
    train_s = time.perf_counter() - t0
    if progress is not None:
        progress(phase, 1.0, f"loss {ema:.3f}")
    return {
        "steps": steps,
        "seconds": train_s,
        "compile_seconds": compile_s,
        "compiled": compiled,
        "tokens": steps * tokens_per_step,
        "tokens_per_s": (steps - 1) * tokens_per_step / max(train_s, 1e-9),
        "train_loss": ema,
    }


def _target_loss(target: Target, batch: torch.Tensor) -> torch.Tensor:
    h = target.features_train(batch[:, :-1])
    logits = F.linear(h, target.model.embed_tokens.weight if target.lm_head is None else
                      target.lm_head.weight)  # fmt: skip
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def train_target(
    cfg: PairConfig,
    token_stream: torch.Tensor,
    device: torch.device | str,
    seconds: float | None = None,
    *,
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> tuple[Target, dict[str, Any]]:
    """Train a fresh ``Target(cfg.model_config())`` on random ``cfg.seq_len`` windows of
    ``token_stream`` [T] int for ``seconds`` (default ``cfg.target_seconds``) of wall clock, or
    ``cfg.max_steps``. Returns the model (fp32, on ``device``, eval mode) and training stats
    (``steps``, ``seconds``, ``tokens``, ``tokens_per_s``, ``train_loss``, ``compiled``...)."""
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    mcfg = cfg.model_config()
    target = Target(mcfg, seed=cfg.seed, std=0.02)
    _scale_residual_init(target.model.layers, mcfg.num_hidden_layers)
    target.to(device).train()
    batches = _batches(token_stream, cfg, device, cfg.seed + 1)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        with _autocast(cfg, device):
            return _target_loss(target, batch)

    stats = _run(
        "target", cfg, list(target.parameters()), loss_fn, batches, device,
        cfg.target_seconds if seconds is None else seconds, cfg.lr, log, progress,
    )  # fmt: skip
    return target.eval(), stats


def _draft_loss(
    draft: Draft, target: Target, batch: torch.Tensor, cfg: PairConfig
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(loss, target logits [B, T, V], draft logits per unrolled pass)."""
    x = batch[:, :-1]
    with torch.no_grad():
        feat = target.features_train(x)
        w = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        tlogits = F.linear(feat, w).float()
        tprob = tlogits.softmax(-1)
    feats = torch.cat([torch.zeros_like(feat[:, :1]), feat[:, :-1]], 1)
    loss = torch.zeros((), device=batch.device)
    outs = []
    for _ in range(max(1, cfg.draft_unroll)):
        dlogits, h = draft.forward_train(target, x, feats)
        ce = -(tprob * dlogits.float().log_softmax(-1)).sum(-1).mean()
        reg = F.smooth_l1_loss(h.float(), feat.float())
        loss = loss + ce + cfg.draft_reg_weight * reg
        outs.append(dlogits)
        feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
    return loss / len(outs), tlogits, outs


def train_draft(
    target: Target,
    cfg: PairConfig,
    token_stream: torch.Tensor,
    device: torch.device | str,
    seconds: float | None = None,
    *,
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> tuple[Draft, dict[str, Any]]:
    """Train a fresh one-layer ``Draft`` against the frozen ``target`` on windows of
    ``token_stream`` (see the module docstring for the losses) for ``seconds`` (default
    ``cfg.draft_seconds``) or ``cfg.max_steps``. The target's embedding and head are shared and
    stay frozen. Returns the draft (fp32, on ``device``, eval mode) and training stats."""
    device = torch.device(device)
    torch.manual_seed(cfg.seed + 2)
    mcfg = target.cfg
    draft = Draft(mcfg, seed=cfg.seed + 2, std=0.02)
    _scale_residual_init([draft.layer], 2)
    draft.to(device).train()
    target.eval().requires_grad_(False)
    batches = _batches(token_stream, cfg, device, cfg.seed + 3)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        with _autocast(cfg, device):
            return _draft_loss(draft, target, batch, cfg)[0]

    try:
        stats = _run(
            "draft", cfg, list(draft.parameters()), loss_fn, batches, device,
            cfg.draft_seconds if seconds is None else seconds, cfg.draft_lr, log, progress,
        )  # fmt: skip
    finally:
        target.requires_grad_(True)
    return draft.eval(), stats


def _eval_windows(stream: torch.Tensor, cfg: PairConfig) -> torch.Tensor:
    """Non-overlapping held-out windows [n, T + 1], at most ``cfg.eval_tokens`` tokens."""
    T = cfg.seq_len
    n = min(stream.numel() // (T + 1), max(1, cfg.eval_tokens // T))
    if n == 0:
        raise ValueError(f"held-out stream of {stream.numel()} tokens is shorter than seq_len + 1")
    return stream[: n * (T + 1)].view(n, T + 1).long()


@torch.no_grad()
def evaluate_target(
    target: Target, stream: torch.Tensor, cfg: PairConfig, device: torch.device | str
) -> dict[str, float]:
    """Held-out next-token ``loss`` (nats/token) and ``top1`` accuracy of ``target`` on
    non-overlapping ``cfg.seq_len`` windows of ``stream`` (up to ``cfg.eval_tokens``)."""
    device = torch.device(device)
    wins = _eval_windows(stream, cfg)
    tot_loss, tot_hit, tot = 0.0, 0, 0
    for i in range(0, wins.shape[0], cfg.batch_size):
        b = wins[i : i + cfg.batch_size].to(device)
        with _autocast(cfg, device):
            h = target.features_train(b[:, :-1])
        logits = target.head(h.float() if h.dtype != torch.float32 else h)
        y = b[:, 1:]
        tot_loss += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
        tot_hit += int((logits.argmax(-1) == y).sum())
        tot += y.numel()
    return {"loss": tot_loss / tot, "top1": tot_hit / tot, "tokens": tot}


@torch.no_grad()
def evaluate_draft(
    draft: Draft, target: Target, stream: torch.Tensor, cfg: PairConfig, device: torch.device | str
) -> dict[str, float]:
    """Held-out top-1 agreement of the draft with the target (teacher-forced): ``agreement``
    with the target's features (a depth-1 proposal), ``agreement_unrolled`` with the draft's own
    features (what deeper proposals see)."""
    device = torch.device(device)
    wins = _eval_windows(stream, cfg)
    hits = [0, 0]
    tot = 0
    c = cfg.replace(draft_unroll=2)
    for i in range(0, wins.shape[0], cfg.batch_size):
        b = wins[i : i + cfg.batch_size].to(device)
        with _autocast(cfg, device):
            _, tlogits, outs = _draft_loss(draft, target, b, c)
        ref = tlogits.argmax(-1)
        for j, o in enumerate(outs):
            hits[j] += int((o.argmax(-1) == ref).sum())
        tot += ref.numel()
    return {"agreement": hits[0] / tot, "agreement_unrolled": hits[1] / tot}


# ------------------------------------------------------------------------------------ the pair
def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def train_pair(
    cfg: PairConfig,
    device: torch.device | str,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> TrainedPair:
    """Data, tokenizer, target, draft and held-out evaluation in one call, cached.

    With ``cache_dir`` holding a pair trained with an equal ``cfg``, that pair is loaded instead
    (``load_pair``); otherwise the new pair is written there: ``target/`` (``config.json`` +
    ``pytorch_model.bin``, ``Target.from_pretrained`` loads it), ``draft.pt`` (state dict),
    ``tokenizer.json``, ``prompts.json``, ``report.json`` and, last, ``pair_config.json``.

    The report: ``target_params``, ``draft_params`` (its own, without the shared embedding/head),
    ``train_tokens``/``heldout_tokens`` in the streams, ``target`` and ``draft`` training stats
    (``tokens_per_s``, ``steps``, ``seconds``...), ``heldout_loss`` and ``heldout_top1`` of the
    target, ``draft_agreement`` (top-1 agreement with the target, depth-1 inputs) and
    ``draft_agreement_unrolled``, timings of each phase, and the device."""
    device = torch.device(device)
    if cache_dir is not None:
        cached = load_pair(cache_dir, device, cfg)
        if cached is not None:
            log(f"loaded the {cfg.name} pair from {cache_dir}")
            return cached
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    elif device.type == "cpu" and hasattr(os, "getloadavg") and os.getloadavg()[0] >= 0.5:
        # Another job holds a core: a second OpenMP thread would spin-wait on it (many times
        # slower on a loaded 2-core machine); one thread keeps the budget's tokens.
        torch.set_num_threads(1)
    try:
        pair = _train_pair(cfg, device, log, progress)
    finally:
        torch.set_num_threads(threads)
    if cache_dir is not None:
        save_pair(pair, cache_dir)
        log(f"saved the pair to {cache_dir}")
    return pair


def _train_pair(
    cfg: PairConfig, device: torch.device, log: Callable[[str], None], progress: Progress | None
) -> TrainedPair:
    times: dict[str, float] = {}
    t = time.perf_counter()
    train_texts, held_texts = python_sources(
        cfg.data_bytes, cfg.heldout_fraction, cfg.seed, max_file_bytes=cfg.max_file_bytes
    )
    times["read_s"] = time.perf_counter() - t
    nbytes = sum(len(s) for s in train_texts)
    log(
        f"data: {len(train_texts)} training files ({nbytes / 1e6:.1f} MB), "
        f"{len(held_texts)} held-out files, read in {times['read_s']:.1f} s"
    )
    t = time.perf_counter()
    tok_texts: list[str] = []
    n = 0
    for s in train_texts:
        if n >= cfg.tokenizer_bytes:
            break
        tok_texts.append(s)
        n += len(s)
    tokenizer = train_tokenizer(tok_texts, cfg.vocab_size)
    times["tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    train_stream = encode_stream(tokenizer, train_texts)
    held_stream = encode_stream(tokenizer, held_texts)
    times["encode_s"] = time.perf_counter() - t
    log(
        f"tokenizer: vocab {tokenizer.get_vocab_size()} in {times['tokenizer_s']:.1f} s; "
        f"{train_stream.numel():,} training / {held_stream.numel():,} held-out tokens "
        f"encoded in {times['encode_s']:.1f} s ({nbytes / max(1, train_stream.numel()):.2f} "
        f"bytes/token)"
    )
    target, tstats = train_target(cfg, train_stream, device, log=log, progress=progress)
    t = time.perf_counter()
    tev = evaluate_target(target, held_stream, cfg, device)
    times["eval_target_s"] = time.perf_counter() - t
    log(
        f"target: {_params(target):,} parameters, {tstats['steps']} steps, "
        f"{tstats['tokens_per_s']:,.0f} tokens/s; held-out loss {tev['loss']:.3f}, "
        f"top-1 {tev['top1']:.1%}"
    )
    draft, dstats = train_draft(target, cfg, train_stream, device, log=log, progress=progress)
    t = time.perf_counter()
    dev = evaluate_draft(draft, target, held_stream, cfg, device)
    times["eval_draft_s"] = time.perf_counter() - t
    log(
        f"draft: {dstats['steps']} steps, {dstats['tokens_per_s']:,.0f} tokens/s; top-1 "
        f"agreement with the target {dev['agreement']:.1%} "
        f"({dev['agreement_unrolled']:.1%} on its own features)"
    )
    prompts = heldout_prompts(tokenizer, held_texts, cfg)
    report: dict[str, Any] = {
        "config": cfg.name,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "target_params": _params(target),
        "draft_params": _params(draft),
        "vocab_size": tokenizer.get_vocab_size(),
        "train_files": len(train_texts),
        "heldout_files": len(held_texts),
        "train_bytes": nbytes,
        "train_tokens": int(train_stream.numel()),
        "heldout_tokens": int(held_stream.numel()),
        "target": tstats,
        "draft": dstats,
        "heldout_loss": tev["loss"],
        "heldout_top1": tev["top1"],
        "heldout_eval_tokens": tev["tokens"],
        "draft_agreement": dev["agreement"],
        "draft_agreement_unrolled": dev["agreement_unrolled"],
        "times": times,
    }
    return TrainedPair(tokenizer, target, draft, prompts, report, cfg)


def save_pair(pair: TrainedPair, cache_dir: str | Path) -> None:
    """Write ``pair`` to ``cache_dir`` (the files ``train_pair`` lists)."""
    d = Path(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "pair_config.json").unlink(missing_ok=True)  # written last: marks a complete pair
    pair.target.save_pretrained(d / "target", safetensors=False)
    torch.save({k: v.detach().cpu() for k, v in pair.draft.state_dict().items()}, d / "draft.pt")
    pair.tokenizer.save(str(d / "tokenizer.json"))
    (d / "prompts.json").write_text(json.dumps(pair.prompts))
    (d / "report.json").write_text(json.dumps(pair.report, indent=1))
    meta = {"format": _FORMAT, "config": pair.config.to_dict()}
    (d / "pair_config.json").write_text(json.dumps(meta, indent=1))


def load_pair(
    cache_dir: str | Path, device: torch.device | str = "cpu", cfg: PairConfig | None = None
) -> TrainedPair | None:
    """The pair saved in ``cache_dir`` (fp32 on ``device``), or None when there is none, it is
    incomplete, or it was trained with a config other than ``cfg`` (any, if ``cfg`` is None)."""
    d = Path(cache_dir)
    try:
        meta = json.loads((d / "pair_config.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != _FORMAT:
        return None
    saved = PairConfig.from_dict(meta["config"])
    if cfg is not None and saved != cfg:
        return None
    from tokenizers import Tokenizer

    try:
        target = Target.from_pretrained(d / "target").to(device).eval()
        draft = Draft(target.cfg)
        draft.load_state_dict(torch.load(d / "draft.pt", map_location="cpu", weights_only=True))
        tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        prompts = json.loads((d / "prompts.json").read_text())
        report = json.loads((d / "report.json").read_text())
    except (OSError, ValueError, RuntimeError):
        return None
    return TrainedPair(tokenizer, target, draft.to(device).eval(), prompts, report, saved)
