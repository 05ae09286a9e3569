"""The example decoder's training data: this machine's own Python source, a byte-level BPE
tokenizer trained on it, token streams and held-out prompts (see ``train.py``)."""

from __future__ import annotations

import functools
import hashlib
import os
import random
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # optional dependency (the ``demo`` extra)
    from tokenizers import Tokenizer

    from .train import PairConfig

__all__ = ["EOS", "python_sources", "train_tokenizer", "encode_stream", "heldout_prompts"]

EOS = "<|endoftext|>"


def _source_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = paths.get(key)
        if p and Path(p).is_dir():
            r = Path(p).resolve()
            if r not in roots:
                roots.append(r)
    return roots


@functools.lru_cache(maxsize=1)
def _python_files() -> tuple[Path, ...]:
    """Every ``.py`` file under the source roots, sorted (cached: walking site-packages takes
    seconds)."""
    seen: set[Path] = set()
    for root in _source_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in filenames:
                if f.endswith(".py"):
                    seen.add(Path(dirpath, f).resolve())
    return tuple(sorted(seen))


_VENDOR_DIRS = frozenset({"_vendor", "_vendored", "vendor", "extern", "_extern"})


def _module_key(path: Path) -> str:
    """The file's module path with vendoring removed (``pip/_vendor/rich/text.py`` and
    ``rich/text.py`` share ``rich/text.py``; ``setuptools/_distutils/core.py`` is
    ``distutils/core.py``): copies of one module share a key, so the split keeps them together."""
    parts = list(path.parts)
    roots = [r for r in _source_roots() if path.is_relative_to(r)]
    if roots:  # the deepest root: site-packages sits inside the (plat)stdlib root of a venv
        parts = list(path.relative_to(max(roots, key=lambda r: len(r.parts))).parts)
    cut = max((i for i, p in enumerate(parts) if p in _VENDOR_DIRS), default=-1)
    parts = parts[cut + 1 :]
    if "_distutils" in parts:
        parts = ["distutils", *parts[parts.index("_distutils") + 1 :]]
    return "/".join(parts)


def python_sources(
    max_bytes: int,
    heldout_fraction: float = 0.05,
    seed: int = 0,
    *,
    max_file_bytes: int = 1 << 18,
) -> tuple[list[str], list[str]]:
    """Real Python source: ``(train_texts, heldout_texts)``, one string per file.

    The ``.py`` files under this interpreter's ``sysconfig`` paths (standard library and
    site-packages), sorted by path and shuffled by ``seed``, are read in that order (skipping
    files that are not UTF-8, are empty, are larger than ``max_file_bytes`` or repeat an earlier
    file's content, as vendored copies do) until ``max_bytes`` of text. The first
    ``heldout_fraction`` of the files read (at least one) are held out, together with every other
    copy of their modules (vendored copies differ in a few import lines, so the content check
    misses them; ``_module_key`` groups them): the split is by module, so no held-out file or near
    copy of it is seen in training. The same seed on the same installation gives the same
    lists."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"Invalid heldout_fraction: expected [0, 1), got {heldout_fraction}")
    files = list(_python_files())
    random.Random(seed).shuffle(files)
    texts: list[str] = []
    keys: list[str] = []
    hashes: set[bytes] = set()
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if not raw.strip() or len(raw) > max_file_bytes:
            continue
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        if digest in hashes:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        hashes.add(digest)
        texts.append(text)
        keys.append(_module_key(path))
        total += len(raw)
    if len(texts) < 2:
        raise RuntimeError(f"found {len(texts)} Python files under {_source_roots()}: need 2+")
    n_held = min(len(texts) - 1, max(1, round(heldout_fraction * len(texts))))
    held_keys = set(keys[:n_held])
    held = [t for t, k in zip(texts, keys) if k in held_keys]
    train = [t for t, k in zip(texts, keys) if k not in held_keys]
    if not train:  # every file one module: keep the first n_held files only
        return texts[n_held:], texts[:n_held]
    return train, held


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style: every byte is a token, so any text round-trips)
    with ``vocab_size`` entries at most, ``<|endoftext|>`` being id 0. Needs ``tokenizers``."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:  # optional dependency
        raise ImportError(
            "training a tokenizer needs 'tokenizers': pip install treeops[demo]"
        ) from e
    if vocab_size < 258:
        raise ValueError(f"Invalid vocab_size: expected >= 258 (256 bytes + EOS), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tokenizer: Tokenizer, texts: Sequence[str], chunk: int = 512) -> torch.Tensor:
    """Every text encoded (``encode_batch``, parallel over texts) into one int32 stream [T], each
    text preceded by EOS (id 0)."""
    eos = tokenizer.token_to_id(EOS)
    enc = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster
    parts: list[torch.Tensor] = []
    for i in range(0, len(texts), chunk):
        for e in enc(list(texts[i : i + chunk]), add_special_tokens=False):
            parts.append(torch.tensor([eos, *e.ids], dtype=torch.int32))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


def heldout_prompts(
    tokenizer: Tokenizer, heldout_texts: Sequence[str], cfg: PairConfig
) -> list[list[int]]:
    """Up to ``cfg.num_prompts`` prompts of ``cfg.prompt_len`` tokens, one per held-out file
    (those long enough), each starting at a seeded random line start of its file."""
    rng = random.Random(cfg.seed)
    # byte-level BPE spells "\n" as "Ċ": the ids whose token ends a line
    newline = {
        i for i in range(tokenizer.get_vocab_size()) if "Ċ" in (tokenizer.id_to_token(i) or "")
    }
    out: list[list[int]] = []
    for text in heldout_texts:
        if len(out) >= cfg.num_prompts:
            break
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) < 2 * cfg.prompt_len:
            continue
        # a line start in the first half of the file (the prompt and a continuation fit after it)
        half = len(ids) - 2 * cfg.prompt_len
        s = rng.choice([0] + [i + 1 for i in range(half) if ids[i] in newline])
        out.append(ids[s : s + cfg.prompt_len])
    return out
