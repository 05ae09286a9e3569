"""warm_peers.py builds what the benches load: every FlashInfer layout bench_tree_attention runs."""

import bench_tree_attention as bta
import warm_peers


def test_every_attention_layout_is_warmed():
    used = {(bta.HQ, bta.HKV, bta.D)} | {s[3:] for s in bta.LAYOUT_SHAPES}
    assert used <= set(warm_peers.ATTENTION_LAYOUTS)


def test_jobs_are_named_per_layout():
    names = [name for name, _ in warm_peers.attention_jobs()]
    assert len(names) == 3 * len(warm_peers.ATTENTION_LAYOUTS) == len(set(names))
    assert [name for name, _ in warm_peers.sampling_jobs()]
