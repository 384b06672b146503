"""GPU-only checks (run on an H200; CI has no GPU, so these skip there): the model's own arguments fit every Triton
kernel (a decode step calls each one); CUDA-graph replay == eager over >= 100 DDTree steps with changing trees for
budgets 4..64, with the Triton kernels in the loop; the compiled step captured as a graph (graph+compile) == eager;
captured steps stay lossless under a drafter broken at random places, and stop by name on logits with no token.
The kernels themselves against their references: tests/test_kernels.py (it runs them directly on a GPU).
Run: python -m pytest -q tests/test_gpu.py"""
import pytest
import torch

import autobudget as A
import checkpoint as C
import draft as dflash
import generate as G
import kernels
import model as M
import runner
import tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# kernel-friendly tiny shapes: kv_lora_rank and rope dim powers of two >= 16, experts a multiple of group 32
CFG = dict(kv_lora_rank=32, qk_rope_head_dim=16, moe_intermediate_size=64, hidden_size=128, vocab_size=256,
           n_routed_experts=16, num_experts_per_tok=4)


def _pair(tmp_path, dtype):
    ref = tiny.write_k26(tmp_path, tiny.text_config(**CFG), seed=3)
    target = C.build(lambda: M.Transformer(C.model_args(tmp_path)), "cuda", dtype)
    C.load_checkpoint(target, str(tmp_path))
    d = C.build(lambda: dflash.DFlashDrafter(C.draft_args(C.tiny_draft_config(ref.args, head_dim=32))),
                "cpu", dtype).cuda()   # head_dim 32: its kernels' sizes
    tiny.randomize_(d, seed=5, std=0.3)
    return target.eval(), d.to(dtype)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_every_kernel_runs_in_a_decode_step(tmp_path, monkeypatch, mode):
    """Every registered kernel's fits() accepts the arguments the model, the drafter, the tree search and verify
    really pass (bf16 INT4 target, DDTree budget 8): a few decode steps call each launcher, eager and captured. A
    kernel whose conditions refused them would leave its op to the reference, correct and slow."""
    target, drafter = _pair(tmp_path, torch.bfloat16)
    calls = tiny.count_launches(monkeypatch)
    G.generate(target, list(range(3, 40)), 24, drafter=drafter, budget=8, max_seq_len=320, mode=mode)
    # run inside the MoE part's launcher, or by the attention part's own attention kernels: on their own only where
    # the part's launcher does not fit (rope still runs on its own: the drafter's context keys)
    inside = {"Gate.forward", "Experts.forward", "mla_attention"}
    want = set(kernels._KERNELS) - inside
    assert set(calls) == want, f"never called: {sorted(want - set(calls))}, called: {sorted(set(calls) - want)}"


def test_compiled_step_keeps_the_routed_experts_kernel(tmp_path, monkeypatch):
    """Under torch.compile the MoE part runs its plain forward (inductor fuses the router's glue itself), and its
    routed experts still take the INT4 kernel (opaque to dynamo): the step's Experts.forward calls reach it."""
    target, drafter = _pair(tmp_path, torch.bfloat16)
    calls = tiny.count_launches(monkeypatch, ["Experts.forward"])
    G.generate(target, list(range(3, 40)), 12, drafter=drafter, budget=8, max_seq_len=320, mode="compile")
    assert calls.get("Experts.forward", 0) > 0


# fp32: every budget. bf16: the budgets whose verify runs the Triton attention kernel in both loops (B+1 <= 64).
# At budget 64 the 65-row verify takes the reference attention, whose bf16 summation can differ between the two loops
# (the live cache slice or the whole cache), enough to flip a near-tie. In fp32 the streams are identical at every
# budget.
@pytest.mark.parametrize("dtype,budgets", [(torch.float32, (4, 8, 16, 32, 64)), (torch.bfloat16, (4, 8, 16, 32))])
def test_graph_replay_equals_eager(tmp_path, dtype, budgets):
    target, drafter = _pair(tmp_path, dtype)
    prompt = list(range(3, 40))
    for budget in budgets:
        runs = {}
        for mode in ("eager", "graph"):
            st = G.Stats()
            out = G.generate(target, prompt, 150, drafter=drafter, budget=budget, max_seq_len=320, stats=st, mode=mode)
            runs[mode] = (out, st.accept_lens)
        assert len(runs["graph"][1]) >= 100                  # >= 100 replayed steps with changing trees
        assert runs["graph"] == runs["eager"], budget


def test_pdl_changes_no_token(tmp_path, monkeypatch):
    """Programmatic dependent launch only moves when kernels start: DDTree replayed as graphs with it == eager
    without it, token for token and accept length for accept length (bf16, where a race would show first)."""
    target, drafter = _pair(tmp_path, torch.bfloat16)
    runs = {}
    for pdl, mode in ((False, "eager"), (True, "graph")):
        monkeypatch.setattr(kernels, "USE_PDL", pdl)
        st = G.Stats()
        out = G.generate(target, list(range(3, 40)), 150, drafter=drafter, budget=8, max_seq_len=320, stats=st,
                         mode=mode)
        runs[pdl] = (out, st.accept_lens)
    assert len(runs[True][1]) >= 100
    assert runs[True] == runs[False]


def test_graph_autoregressive_equals_eager(tmp_path):
    target, _ = _pair(tmp_path, torch.bfloat16)
    a = G.generate(target, [5, 6, 7], 64, max_seq_len=128)
    b = G.generate(target, [5, 6, 7], 64, max_seq_len=128, mode="graph")
    assert a == b


@pytest.mark.parametrize("budget", [0, 8])
def test_compiled_graph_equals_eager(tmp_path, budget):
    """--cuda-graph --compile: the torch.compile'd step captured as a CUDA graph (the fused INT4 MoE stays an
    opaque call inside it) commits the eager loop's tokens, float32, >= 60 steps."""
    target, drafter = _pair(tmp_path, torch.float32)
    prompt = list(range(3, 40))
    runs = {}
    for mode in ("eager", "graph+compile"):
        st = G.Stats()
        out = G.generate(target, prompt, 100, drafter=drafter if budget else None, budget=budget, max_seq_len=320,
                         stats=st, mode=mode)
        runs[mode] = (out, st.accept_lens)
    assert len(runs["graph+compile"][1]) >= (60 if budget else 99)
    assert runs["graph+compile"] == runs["eager"]


def test_compiled_bf16_keeps_acceptance():
    """graph+compile in bf16 accepts as many tokens a step as graph does (bundled pair, two code prompts, budget 8):
    runner.COMPILE_OPTIONS makes inductor round intermediates where eager rounds, else the compiled step commits
    the same tokens but drafts worse. The two loops run different glue kernels (Triton in graph, inductor's in
    graph+compile), so their bf16 streams may still part at a near-tie; hence the mean, within 5%."""
    import bench
    dev = torch.device("cuda")
    target = C.load_model(G.BUNDLED_TARGET, dev, torch.bfloat16, progress=False)
    drafter = C.load_drafter(G.BUNDLED_DRAFT, target.args, dev, torch.bfloat16)
    prompts = bench.encode_prompts(bench.load_prompts(bench.PROMPTS_FILE, 2), G.BUNDLED_TARGET,
                                   target.args.vocab_size, False)[0]
    accept = {}
    for mode in ("graph", "graph+compile"):
        lens = []
        for ids in prompts:
            st = G.Stats()
            G.generate(target, ids, 96, drafter=drafter, budget=8, max_seq_len=512, stats=st, mode=mode)
            lens += st.accept_lens
        accept[mode] = sum(lens) / len(lens)
    assert accept["graph+compile"] >= 0.95 * accept["graph"], accept


def test_trace_reads_graph_steps_as_eager(tmp_path):
    """--trace with --cuda-graph: each replay's View (the captured step's outputs) is read after the replay, and the
    page's records (trees, the target's tokens, accepted paths, committed tokens) equal the eager run's."""
    from trace_page import Trace
    target, drafter = _pair(tmp_path, torch.float32)
    prompt, records = list(range(3, 40)), {}
    for mode in ("eager", "graph"):
        trace, stats = Trace(lambda ids: " ".join(map(str, ids)), {"budget": 8}), G.Stats()
        trace.begin([prompt], stats)
        G.generate(target, prompt, 40, drafter=drafter, budget=8, max_seq_len=320, mode=mode, on_step=trace.on_step,
                   stats=stats)
        records[mode] = [(s.tokens, s.parents, s.targets, s.path, s.new) for s in trace.runs[0][0].steps]
    assert len(records["eager"]) >= 5 and records["graph"] == records["eager"]


def test_auto_graph_equals_eager_and_autoregressive(tmp_path, monkeypatch):
    """--budget auto with --cuda-graph: the tree, one-token and catch_up graphs (catch_up captured by AutoStep,
    before the clock), replayed in the order the real controller or a script picks (one-token stretches longer and
    shorter than a block, each followed by a catch_up, trees right after trees), commit the eager loop's tokens,
    which are the autoregressive ones (fp32)."""
    import itertools
    target, drafter = _pair(tmp_path, torch.float32)
    prompt = list(range(3, 40))
    ar = G.generate(target, prompt, 120, max_seq_len=320)
    for mode in ("eager", "graph"):
        kept = runner.Steps()
        assert G.generate(target, prompt, 120, drafter=drafter, budget="auto", max_seq_len=320, mode=mode,
                          steps=kept) == ar
        (step,) = kept.values()
        assert step.auto is not None
    assert {fn.__name__ for fn in step.runner.graphs} == {"tree_step", "token_step", "catch_up"}
    T, F = True, False
    runs = {}
    for mode in ("eager", "graph"):
        picks = itertools.cycle([F] * 40 + [T, T] + [F] * 4 + [T] + [F] * 9 + [T, F, F, T, T])   # the same in both
        monkeypatch.setattr(A.AutoBudget, "tree", lambda self: next(picks))
        kept = runner.Steps()
        st = G.Stats()
        runs[mode] = G.generate(target, prompt, 120, drafter=drafter, budget="auto", max_seq_len=320, mode=mode,
                                stats=st, steps=kept), st.accept_lens
        assert set(st.budgets) == {0, G.AUTO_BUDGET}
    assert runs["graph"] == runs["eager"] and runs["graph"][0] == ar
    (step,) = kept.values()
    assert {fn.__name__ for fn in step.runner.graphs} == {"tree_step", "token_step", "catch_up"}


@pytest.mark.parametrize("kw", [dict(budget=8), dict(budget=16), dict(chain=True), dict(budget="auto")])
def test_hostile_drafter_graph_equals_autoregressive(tmp_path, monkeypatch, kw):
    """Lossless under any drafter, captured: drafts broken at random places (tiny.corrupt_logits; each replay draws new
    NaN rows and spots, +-inf, all -inf, +-3e38, all-equal rows, through the Triton rank and search kernels) commit
    the autoregressive tokens in graph mode (fp32), for one prompt and for a batch of three; the broken drafts reach
    the replayed trees. --budget auto follows a script of trees, one-token stretches and catch_ups."""
    import itertools
    if kw.get("budget") == "auto":
        picks = itertools.cycle([False] * 6 + [True, True] + [False] * 2 + [True] + [False] * 9 + [True] * 3)
        monkeypatch.setattr(A.AutoBudget, "tree", lambda self: next(picks))
    target, drafter = _pair(tmp_path, torch.float32)
    prompts = [list(range(3, 40)), [5, 9, 2], list(range(60, 75))]
    ars = [G.generate(target, p, 80, max_seq_len=320) for p in prompts]
    batch_ar = G.generate_batch(target, prompts, 80, max_seq_len=320)   # the batch's own (its shapes' rounding)
    seqs = [p + a for p, a in zip(prompts, ars)]
    ref = torch.tensor([s + [0] * (max(map(len, seqs)) - len(s)) for s in seqs], device="cuda")   # the oracle
    broken = []
    on_step = lambda b, view, new: broken.append(bool((~view.draft_logits[b].isfinite()).any()))
    kept = runner.Steps()
    out = G.generate(target, prompts[0], 80, drafter=tiny.HostileDrafter(drafter, ref[:1]), max_seq_len=320,
                     mode="graph", on_step=on_step, **kw, steps=kept)
    assert out == ars[0]
    assert sum(broken) >= len(broken) // 3 and len(broken) >= 10, broken
    assert G.generate_batch(target, prompts, 80, drafter=tiny.HostileDrafter(drafter, ref), max_seq_len=320,
                            mode="graph", **kw, steps=kept) == batch_ar
    assert all(s.runner.graphs for s in kept.values())                  # every step ran as a replay


def test_no_token_stops_graph_mode(tmp_path, monkeypatch):
    """Logits with no token to give inside a captured step (NaN after one token of the output): the replay's
    verify.NO_TOKEN reaches the host in the step's one copy, and the run stops with the error naming that token's
    position, after streaming exactly the autoregressive tokens up to it; autoregressive, DDTree and chain."""
    target, drafter = _pair(tmp_path, torch.float32)
    prompt = list(range(3, 40))
    ar = G.generate(target, prompt, 40, max_seq_len=320)
    k = next(j for j in range(8, len(ar)) if ar[j] not in prompt + ar[:j])       # ar[k]'s first occurrence
    tiny.nan_logits_where(target, monkeypatch, lambda tokens, pos: tokens == ar[k])
    for kw in (dict(budget=0), dict(drafter=drafter, budget=8), dict(drafter=drafter, chain=True)):
        seen = []
        kept = runner.Steps()
        with pytest.raises(RuntimeError, match=rf"^decoding step \d+: the target's logits after position "
                                               rf"{len(prompt) + k} give no token"):
            G.generate(target, prompt, 40, max_seq_len=320, mode="graph", on_tokens=seen.extend, **kw, steps=kept)
        assert seen == ar[:k + 1], kw
        assert all(s.runner.graphs for s in kept.values())
