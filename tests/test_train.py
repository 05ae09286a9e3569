"""The training side of the example decoder (``treeops.decoder.train``), on CPU, in seconds.

The training forwards (``Target.forward_train``, ``Draft.forward_train``: causal SDPA over whole
sequences) must compute what the decoder's cached tree forwards compute with the same weights;
the data split is by file and reproducible; the tokenizer round-trips; ``train_pair`` on the
``micro`` preset trains, caches and loads back the same weights. No minute-long training here.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from treeops.decoder import Draft, ModelConfig, Target
from treeops.decoder.model import chain_tree, reference_forward
from treeops.decoder.train import (
    PairConfig,
    encode_stream,
    load_pair,
    python_sources,
    train_pair,
    train_tokenizer,
)

pytest.importorskip("tokenizers")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread (see tests/test_decoder.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CFG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
)


@torch.no_grad()
def test_training_forward_equals_inference_forward():
    target = Target(CFG, seed=3)
    draft = Draft(CFG, seed=4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (2, 19), generator=g)
    logits, h = target.forward_train(tokens)
    for b in range(2):
        assert_close(logits[b], reference_forward(target, tokens[b]), torch.float32)
    # the decoder's path: the whole sequence as a chain tree against an empty paged cache
    zero = torch.zeros(2, dtype=torch.int32)
    chain = chain_tree(tokens, torch.full((2,), 19))
    t_logits, t_h = target(tokens, target.make_cache(2, 32), zero, chain)
    assert_close(logits, t_logits, torch.float32)
    assert_close(h, t_h, torch.float32)
    feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
    d_logits, d_h = draft.forward_train(target, tokens, feats)
    i_logits, i_h = draft(target, tokens, feats, draft.make_cache(2, 32), zero, chain)
    assert_close(d_logits, i_logits, torch.float32)
    assert_close(d_h, i_h, torch.float32)


def test_python_sources_split_by_file_and_deterministic():
    # small files only, so that the 150 kB hold many files whatever this installation holds
    kw = dict(heldout_fraction=0.2, max_file_bytes=1 << 13)
    train, held = python_sources(150_000, seed=5, **kw)
    train2, held2 = python_sources(150_000, seed=5, **kw)
    assert (train, held) == (train2, held2)
    assert len(held) >= 1 and len(train) >= 1
    assert not set(train) & set(held)  # whole files, no file on both sides
    assert max(map(len, train + held)) <= 1 << 13
    n = len(train) + len(held)
    assert n >= 150_000 // (1 << 13)
    n_held = min(n - 1, max(1, round(0.2 * n)))  # the documented rule
    assert n_held <= len(held) <= n_held + 0.05 * n  # + copies of held modules
    assert sum(map(len, train + held)) >= 150_000 - max(map(len, train + held))
    other, _ = python_sources(150_000, seed=6, **kw)
    assert other != train


def test_tokenizer_round_trips():
    texts = [
        "def f(x):\n    return x + 1  # über\n",
        "class A:\n\tpass\n\n\nprint('héllo', \"wörld\")\n",
    ] * 5
    tok = train_tokenizer(texts, 300)
    assert 258 <= tok.get_vocab_size() <= 300
    assert tok.token_to_id("<|endoftext|>") == 0
    for s in [*texts, "λ → ∞ 🙂 unseen\r\n\x00"]:
        assert tok.decode(tok.encode(s).ids) == s
    stream = encode_stream(tok, texts[:2])
    assert stream.dtype == torch.int32 and int(stream[0]) == 0
    assert int((stream == 0).sum()) == 2


def test_train_pair_micro_caches_and_reloads(tmp_path):
    cfg = PairConfig.micro().replace(max_steps=3)
    lines: list[str] = []
    pair = train_pair(cfg, "cpu", tmp_path, log=lines.append)
    r = pair.report
    assert r["target"]["steps"] == 3 and r["draft"]["steps"] == 3
    assert r["target_params"] > r["draft_params"] > 0
    assert 0 < r["heldout_loss"] < 10 and 0 <= r["heldout_top1"] <= 1
    assert 0 <= r["draft_agreement"] <= 1
    assert pair.prompts and all(len(p) == cfg.prompt_len for p in pair.prompts)
    assert (tmp_path / "pair_config.json").exists()

    lines.clear()
    again = train_pair(cfg, "cpu", tmp_path, log=lines.append)
    assert any("loaded" in s for s in lines)
    for a, b in [(pair.target, again.target), (pair.draft, again.draft)]:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert again.prompts == pair.prompts and again.report == r
    assert again.tokenizer.to_str() == pair.tokenizer.to_str()
    assert load_pair(tmp_path, "cpu", cfg.replace(seed=1)) is None  # another config: retrain


def test_module_key_groups_vendored_copies():
    """Vendored copies of a module share its key, so the held-out split keeps them together."""
    from treeops.decoder.data import _module_key, _source_roots

    site = _source_roots()[-1]  # paths under a real root (the files need not exist)
    key = lambda p: _module_key(site / p)  # noqa: E731
    assert key("pip/_vendor/rich/text.py") == key("rich/text.py") == "rich/text.py"
    assert key("setuptools/_vendor/packaging/version.py") == "packaging/version.py"
    assert key("setuptools/_distutils/core.py") == "distutils/core.py"
    assert key("requests/utils.py") != key("urllib3/util/retry.py")
