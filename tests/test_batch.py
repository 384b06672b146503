"""Batched decoding: each sequence of a batch produces exactly the tokens it produces alone (greedy, fp32),
with short and long prompts, early stops and per-sequence trees; a finished sequence's committed cache slots
are never touched again. Run: python -m pytest -q tests/test_batch.py"""
import pytest
import torch

import checkpoint as C
import draft as dflash
import generate as G
import tiny


@pytest.fixture(scope="module")
def pair():
    target = tiny.random_model(tiny.text_config(), seed=13)
    d = dflash.DFlashDrafter(C.draft_args(C.tiny_draft_config(target.args)))
    tiny.randomize_(d, seed=6, std=0.3)
    return target, d


PROMPTS = [[5, 9, 2], list(range(10, 40)), [7], list(range(50, 62))]


@pytest.mark.parametrize("budget", [0, pytest.param(4, marks=pytest.mark.quick), 16])
def test_batch_equals_single(pair, budget):
    target, drafter = pair
    drafter = drafter if budget else None
    alone = [G.generate(target, p, 24, drafter=drafter, budget=budget, max_seq_len=128) for p in PROMPTS]
    stop = alone[1][5]          # sequence 1 stops early; others may too, wherever this token appears
    alone_stop = [G.generate(target, p, 24, drafter=drafter, budget=budget, max_seq_len=128, stop_ids=[stop])
                  for p in PROMPTS]
    assert len(alone_stop[1]) == 6
    batch = G.generate_batch(target, PROMPTS, 24, drafter=drafter, budget=budget, max_seq_len=128, stop_ids=[stop])
    assert batch == alone_stop
    assert G.generate_batch(target, PROMPTS, 24, drafter=drafter, budget=budget, max_seq_len=128) == alone


@pytest.mark.parametrize("max_seq_len", [40, 45])
def test_batch_at_the_cache_end(pair, max_seq_len):
    """Rows of different lengths reach the cache end: once a tree no longer fits some row, the batch goes on one
    token a step, and each row stops when its cache is full; every row still equals its own run."""
    target, drafter = pair
    alone = [G.generate(target, p, 60, drafter=drafter, budget=8, max_seq_len=max_seq_len) for p in PROMPTS]
    stats = G.Stats()
    assert G.generate_batch(target, PROMPTS, 60, drafter=drafter, budget=8, max_seq_len=max_seq_len,
                            stats=stats) == alone
    assert all(len(p) + len(o) == max_seq_len + 1 for p, o in zip(PROMPTS, alone)) and "cache full" in stats.stopped


def test_finished_rows_are_frozen(pair, monkeypatch):
    """Row 2 stops on its first token; every later step leaves its committed cache slots (target and
    drafter) bit-identical, while the other rows decode exactly as they would alone."""
    target, drafter = pair
    prompts = [[1, 2, 3, 4], [8, 8, 8, 8, 8, 8], [3]]
    first = G.generate(target, prompts[2], 1, max_seq_len=96)[0]
    snaps = []
    call = G.Step.run

    def spy(self, fn, hook=None):
        out = call(self, fn, hook)
        snaps.append((target.kv_cache[:, 2, :1].clone(), drafter.ctx_cache[:, :, 2, :1].clone()))
        return out
    monkeypatch.setattr(G.Step, "run", spy)
    out = G.generate_batch(target, prompts, 20, drafter=drafter, budget=8, max_seq_len=96, stop_ids=[first])
    assert out[2] == [first] and len(snaps) >= 3
    for kv, ctx in snaps[1:]:
        assert torch.equal(kv, snaps[0][0]) and torch.equal(ctx, snaps[0][1])
    monkeypatch.setattr(G.Step, "run", call)
    for b in (0, 1):
        assert out[b] == G.generate(target, prompts[b], 20, drafter=drafter, budget=8, max_seq_len=96,
                                    stop_ids=[first])


@pytest.mark.quick
def test_a_row_that_stops_early_while_the_others_reach_the_cache_end(pair, monkeypatch):
    """Row 1 stops on a stop token within its first 6 tokens; the others decode on to the cache end. A finished
    row commits nothing more: its cache position stays (were it to advance, its writes would run on towards its
    cache row's end), and every row equals its own run."""
    target, drafter = pair
    starts, run = [], G.Step.run

    def spy(self, fn, hook=None):
        out = run(self, fn, hook)
        starts.append(int(self.state.start[1]))
        return out
    prompts = [[5, 9, 2], [7, 7], list(range(10, 22))]
    free = [G.generate(target, p, 100, drafter=drafter, budget=4, max_seq_len=48) for p in prompts]
    stop = next(t for t in free[1][1:6] if all(t not in o for b, o in enumerate(free) if b != 1))
    alone = [G.generate(target, p, 100, drafter=drafter, budget=4, max_seq_len=48, stop_ids=[stop]) for p in prompts]
    assert len(alone[1]) <= 6 and all(len(p) + len(o) == 49 for b, (p, o) in enumerate(zip(prompts, alone)) if b != 1)
    monkeypatch.setattr(G.Step, "run", spy)
    assert G.generate_batch(target, prompts, 100, drafter=drafter, budget=4, max_seq_len=48, stop_ids=[stop]) == alone
    assert len(starts) > 12 and len(set(starts[6:])) == 1, starts
