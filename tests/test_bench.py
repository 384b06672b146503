"""bench.py at tiny sizes on CPU (--device cpu, also on a GPU host): every mode runs, and its JSON report is
self-consistent (tokens/s = tokens / time, the accept histogram counts every step, speedups are ratios of the
reported rates, floors are positive, greedy speculative output == autoregressive output).
Run: python -m pytest -q tests/test_bench.py"""
import json
import math

import pytest
import torch

import bench
import checkpoint as C
import draft as Dr
import generate as G
import kernels
import model as M
import tiny
import verify

torch.set_default_dtype(torch.float32)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only add overhead (badly so on a shared, loaded CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random tiny K2.6-layout target and a random tiny DFlash drafter for it."""
    d = tmp_path_factory.mktemp("bench")
    tiny.write_k26(d / "target", tiny.text_config(), seed=5)
    cfg = C.tiny_draft_config(C.model_args(str(d / "target")))
    drafter = Dr.DFlashDrafter(C.draft_args(cfg))
    tiny.randomize_(drafter, 1, std=0.2)
    C.write_drafter(str(d / "draft"), drafter, cfg)
    return d


def close(a, b, rel=1e-9):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_e2e(pair, capsys):
    out = pair / "e2e.json"
    res = bench.main(["e2e", "--device", "cpu", "--ckpt", str(pair / "target"), "--draft", str(pair / "draft"),
                      "--budgets", "1,4", "--n-prompts", "2", "--max-new-tokens", "12", "--warmup", "2",
                      "--out", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1]) == json.loads(json.dumps(res))     # last line: the JSON
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert "matplotlib not installed: skipping the plot" in printed or (pair / "e2e.png").exists()
    env = res["env"]
    assert env["torch"] == torch.__version__ and env["argv"][:2] == ["bench.py", "e2e"] and env["date"]
    e2e = res["e2e"]
    assert len(e2e["prompts"]) == 2 and {p["category"] for p in e2e["prompts"]} <= {"code", "math", "prose"}
    runs = e2e["runs"]
    assert [(r["temperature"], r["mode"], r["budget"]) for r in runs] == [
        (t, m, b) for t in (0.0, 1.0) for m, b in (("ar", None), ("chain", None), ("ddtree", 1), ("ddtree", 4))]
    for r in runs:
        ar = next(x for x in runs if x["mode"] == "ar" and x["temperature"] == r["temperature"])
        assert r["tokens"] == 2 * (12 - 1)                       # no stop ids: every prompt runs to the limit
        assert close(r["tokens_per_s"], r["tokens"] / r["time_s"]) and r["tokens_per_s"] > 0
        assert close(r["speedup"], r["tokens_per_s"] / ar["tokens_per_s"])
        assert sum(r["accept_hist"].values()) == r["steps"] > 0
        assert sum(int(k) * v for k, v in r["accept_hist"].items()) == r["accept_sum"]
        assert close(r["mean_accept"], r["accept_sum"] / r["steps"])
        assert r["accept_sum"] >= r["tokens"]                    # the last step may commit past the limit
        assert sum(p["steps"] for p in r["per_prompt"]) == r["steps"]
        assert set(r["stage_ms_per_step"]) == {"draft", "tree", "verify", "commit"}
        assert close(sum(r["stage_ms_per_step"].values()), 1e3 * sum(r["stage_s"].values()) / r["steps"])
        assert r["peak_rss_bytes"] > 0 and r["cuda_max_allocated_bytes"] is None
        if r["mode"] == "ar":
            assert r["accept_hist"] == {"1": r["steps"]} and r["lossless"] is None
        elif r["temperature"] == 0:
            assert r["lossless"] is True and all(p["lossless"] for p in r["per_prompt"])
        else:
            assert r["lossless"] is None                         # sampled: outputs differ by design
        if r["mode"] == "ddtree":
            assert r["verify_tokens"] == r["budget"] + 1 and max(map(int, r["accept_hist"])) <= r["budget"] + 1


def test_step_mode(pair, capsys):
    """step: the pair's AR and DDTree steps, each replayed from the same restored inputs (every timed call commits the
    same tokens); on a CPU the static step only, without profiler kernels or the graph-node floor."""
    res = bench.main(["step", "--device", "cpu", "--ckpt", str(pair / "target"), "--draft", str(pair / "draft"),
                      "--step-budgets", "0,4"])["step"]
    assert [(r["mode"], r["budget"]) for r in res["rows"]] == [("static", 0), ("static", 4)]
    assert all(r["us"] > 0 and r["same_step"] and r["kernels_us"] is None for r in res["rows"])
    assert res["graph_node_floor"] == []
    assert "## step" in capsys.readouterr().out


def test_layers(capsys):
    res = bench.main(["layers", "--device", "cpu", "--scale", "tiny", "--tp", "8", "--ctx", "32,64", "--T", "1,9",
                      "--copy-mb", "8", "--allreduce-us", "20"])
    assert last_json(capsys) == json.loads(json.dumps(res))
    lay = res["layers"]
    assert lay["copy_bandwidth_Bps"] > 0 and lay["scale"] == "tiny" and lay["tp"] == 8
    cfg = bench.k26_text_config("tiny")
    rows = lay["rows"]
    assert {(r["layer"], r["ctx"], r["T"]) for r in rows} == {(k, c, t) for k in ("moe", "dense") for c in (32, 64)
                                                             for t in (1, 9)}
    for r in rows:
        b = r["bytes"]
        assert r["floor_us"] > 0 and r["eager_us"] > 0 and b["total"] == sum(v for k, v in b.items() if k != "total")
        assert close(r["floor_us"], b["total"] / lay["copy_bandwidth_Bps"] * 1e6)
        assert close(r["mbu"], r["floor_us"] / r["eager_us"])   # CPU: no CUDA-graph time
        assert b["kv_cache"] == (r["ctx"] + r["T"]) * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
        if r["layer"] == "moe":
            k, E = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
            assert (r["experts"] == k) if r["T"] == 1 else (k <= r["experts"] <= min(E, k * r["T"]))
            per_expert = b["routed_experts"] // r["experts"]
            inter = cfg["moe_intermediate_size"] // 8
            D = cfg["hidden_size"]      # INT4 words + fp32 scales (fp32 run) of gate/up and down, one rank
            w13, w2 = 2 * inter * D, D * inter                   # int4 values per matrix pair / matrix
            assert per_expert == (w13 + w2) // 8 * 4 + (w13 + w2) // 32 * 4
    moe = {(r["ctx"], r["T"]): r for r in rows if r["layer"] == "moe"}
    dense = {(r["ctx"], r["T"]): r for r in rows if r["layer"] == "dense"}
    head = {h["T"]: h for h in lay["lm_head"]}
    for p in lay["projection"]:
        m, d, h = moe[p["ctx"], p["T"]], dense[p["ctx"], p["T"]], head[p["T"]]
        assert close(p["comm_ms"], (2 * 61 + 2) * 20 / 1e3)
        assert close(p["layers_ms"], (60 * m["eager_us"] + d["eager_us"] + h["us"]) / 1e3)
        assert close(p["step_ms"], p["layers_ms"] + p["comm_ms"])
        assert close(p["floor_ms"], (60 * m["floor_us"] + d["floor_us"] + h["floor_us"]) / 1e3)
        ar = next(q for q in lay["projection"] if q["ctx"] == p["ctx"] and q["T"] == 1)
        assert close(p["breakeven_accept"], p["step_ms"] / ar["step_ms"])
        assert close(p["ar_tokens_per_s"], 1e3 / ar["step_ms"])
    assert any("124 x 20 us" in s for s in lay["assumptions"])


def test_layers_compile_column(capsys):
    """--compile times torch.compile of the block next to eager (issue 10's eager vs compile vs graph); the
    best time of the row, and so the MBU and the projection, takes it into account."""
    res = bench.main(["layers", "--device", "cpu", "--scale", "tiny", "--tp", "8", "--ctx", "16", "--T", "1",
                      "--copy-mb", "8", "--no-dense", "--compile"])
    assert last_json(capsys) == json.loads(json.dumps(res))
    (r,) = res["layers"]["rows"]
    assert r["compile_error"] is None and r["compile_us"] > 0
    assert close(r["mbu"], r["floor_us"] / min(r["eager_us"], r["compile_us"]))
    assert r["graph_us"] is None                          # CPU: no CUDA graph


def test_layers_fusions(capsys, monkeypatch):
    """--fusions times the MoE block again with each fusion of kernels.FUSE off in turn (and only then: each one is
    back on after), one row per (fusion, ctx, T) beside the all-on row it is compared with."""
    seen = []
    real = bench.time_block
    monkeypatch.setattr(bench, "time_block", lambda *a, **k: seen.append(dict(kernels.FUSE)) or real(*a, **k))
    res = bench.main(["layers", "--device", "cpu", "--scale", "tiny", "--tp", "8", "--ctx", "16", "--T", "1,9",
                      "--copy-mb", "8", "--no-dense", "--fusions"])
    assert last_json(capsys) == json.loads(json.dumps(res))
    names = list(kernels.FUSE)
    assert seen == [dict.fromkeys(names, True)] + [dict(dict.fromkeys(names, True), **{n: False}) for n in names]
    assert all(kernels.FUSE.values())
    rows, on = res["layers"]["fusions"], res["layers"]["rows"]
    assert [(r["fusion"], r["T"]) for r in rows] == [(n, T) for n in names for T in (1, 9)]
    assert [r["graph_us_on"] for r in rows] == [None] * len(rows)                     # CPU: no CUDA graph
    assert [r["n_kernels_on"] for r in rows[:2]] == [r["n_kernels"] for r in on]


def test_moe_split(capsys):
    res = bench.main(["moe-split", "--device", "cpu", "--scale", "tiny", "--tp", "8", "--T", "1,9", "--copy-mb", "8"])
    assert last_json(capsys) == json.loads(json.dumps(res))
    ms = res["moe-split"]
    cfg = bench.k26_text_config("tiny")
    E, k, D, I = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    expert_bytes = 3 * I * D // 8 * 4 + 3 * I * D // 32 * 4          # one whole expert: INT4 words + fp32 scales
    assert sorted({r["T"] for r in ms["rows"]}) == [1, 9]
    for r in ms["rows"]:
        assert k <= r["distinct_experts"] <= min(E, k * r["T"])
        assert 1 <= r["ep_max_experts"] <= min(E // 8, r["distinct_experts"])
        assert r["tp_us"] > 0 and r["ep_max_us"] >= r["ep_mean_us"] > 0
        assert close(r["tp_floor_us"], r["distinct_experts"] * expert_bytes / 8 / ms["copy_bandwidth_Bps"] * 1e6)
        assert close(r["ep_floor_us"], r["ep_max_experts"] * expert_bytes / ms["copy_bandwidth_Bps"] * 1e6)


def test_tree_mode(capsys):
    res = bench.main(["tree", "--vocab", "300", "--tree-depth", "3", "--budgets", "4,8"])
    assert last_json(capsys) == json.loads(json.dumps(res))
    rows = res["tree"]["rows"]
    assert [r["budget"] for r in rows] == [4, 8] and all(r["depth"] == 3 and r["vocab"] == 300 for r in rows)
    for r in rows:
        assert r["ops_us"] > 0 and r["rank_us"] > 0
        if torch.cuda.is_available():        # the one-launch search: timed and the same tree as the ops builder
            assert r["kernel_us"] > 0 and r["same"] is True
        else:
            assert r["kernel_us"] is None and r["same"] is None


def test_draft_replicated_vs_tp(capsys):
    res = bench.main(["draft", "--device", "cpu", "--scale", "tiny", "--tp", "8", "--ctx", "16", "--copy-mb", "8",
                      "--allreduce-us", "20"])
    assert last_json(capsys) == json.loads(json.dumps(res))
    rows = {r["tp"]: r for r in res["draft"]["rows"]}
    assert set(rows) == {1, 8}
    # per-rank weights: 1/8 of the split matrices, norms replicated
    assert rows[8]["weights_MB"] < rows[1]["weights_MB"] / 8 * 1.05
    assert rows[1]["comm_us"] == 0 and close(rows[8]["comm_us"], (2 * 6 + 1) * 20)
    for r in rows.values():
        assert close(r["total_us"], r["us"] + r["comm_us"])


def test_layers_tp1_shapes_hold_all_heads():
    """Per-rank shapes: at TP1 the attention weights are larger than rank 0's slice at TP8 (only q_a and
    kv_a are replicated), and the forward never calls a collective (no process group exists here)."""
    cfg = bench.k26_text_config("tiny")
    sizes = {}
    for tp in (1, 8):
        args, block = bench.build_block(cfg, 1, tp, "cpu", torch.float32, seed=0)
        assert M.world_size == 1 and block.self_attn.n_heads == cfg["num_attention_heads"] // tp
        assert block.mlp.experts.inter == cfg["moe_intermediate_size"] // tp
        s = bench.step_inputs(args, 5, 16, "random", "cpu", torch.float32, seed=0)
        cache = torch.randn(1, 24, args.kv_lora_rank + args.qk_rope_head_dim)
        with torch.no_grad():
            y = block(s["x"], s["cos"], s["sin"], cache, 16, s["mask"], True, s["slots"])
        assert y.shape == (1, 5, cfg["hidden_size"]) and torch.isfinite(y).all()
        sizes[tp] = bench.param_bytes(block.self_attn)
    assert sizes[1] > sizes[8]


def test_peer(pair, capsys):
    res = bench.main(["peer", "--device", "cpu", "--scale", "tiny", "--tp", "2", "--ctx", "32", "--T", "1,9",
                      "--ckpt", str(pair / "target"), "--max-new-tokens", "8", "--peer-experts", "eager"])
    assert last_json(capsys) == json.loads(json.dumps(res))
    peer = res["peer"]
    assert {(r["layer"], r["T"]) for r in peer["rows"]} == {(k, t) for k in ("moe", "dense") for t in (1, 9)}
    for r in peer["rows"]:
        assert r["ours_us"] > 0 and r["peer_us"] > 0 and close(r["speedup"], r["peer_us"] / r["ours_us"])
        assert r["rel_err"] < 1e-4, r             # same weights, fp32: the two implementations agree
    e = peer["e2e"]
    assert e["same_tokens"] is True and close(e["speedup"], e["peer_s"] / e["ours_s"])
    assert close(e["ours_tokens_per_s"], e["new_tokens"] / e["ours_s"])


def test_missing_bundled_checkpoint_is_a_clear_error(tmp_path):
    a = bench.parse_args(["e2e", "--ckpt", str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="train.py"):
        bench._e2e_paths(a)


def test_prompt_set():
    prompts = bench.load_prompts(bench.PROMPTS_FILE)
    assert len(prompts) >= 10 and {p["category"] for p in prompts} == {"code", "math", "prose"}
    assert len({p["id"] for p in prompts}) == len(prompts) and all(p["text"].strip() for p in prompts)


def test_e2e_batch_and_static_steps(pair, capsys):
    res = bench.main(["e2e", "--device", "cpu", "--ckpt", str(pair / "target"), "--draft", str(pair / "draft"),
                      "--budgets", "4", "--n-prompts", "3", "--max-new-tokens", "8", "--batch", "1,4"])
    rows = res["e2e"]["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "ar"), (1, "ddtree"), (4, "ar"), (4, "ddtree")]
    assert all(r["lossless"] for r in rows)                          # greedy: every mode's outputs == AR's
    for r in rows:
        assert r["tokens"] == 8 * r["batch"]                     # no stop ids: every request runs to the limit
        assert close(r["total_tokens_per_s"], r["tokens"] / r["time_s"])
        assert close(r["per_request_tokens_per_s"], r["total_tokens_per_s"] / r["batch"])
    res = bench.main(["e2e", "--device", "cpu", "--ckpt", str(pair / "target"), "--draft", str(pair / "draft"),
                      "--budgets", "auto", "--n-prompts", "2", "--max-new-tokens", "8", "--batch", "3"])
    ar, auto = res["e2e"]["rows"]
    assert (ar["mode"], auto["mode"], auto["budget"]) == ("ar", "auto", "auto") and auto["lossless"]
    assert auto["budget_mix"] and sum(int(m.split(":")[1][:-1]) for m in auto["budget_mix"].split()) in (99, 100, 101)
    assert "steps per budget" in capsys.readouterr().out
    res = bench.main(["e2e", "--device", "cpu", "--ckpt", str(pair / "target"), "--draft", str(pair / "draft"),
                      "--budgets", "4", "--n-prompts", "2", "--max-new-tokens", "10", "--temperature", "0",
                      "--step-mode", "static", "--warmup", "0"])
    assert all(r["lossless"] for r in res["e2e"]["runs"] if r["mode"] != "ar")


def test_heldout_prompts_are_windows_of_the_heldout_files(tmp_path):
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    lst = tmp_path / "heldout_files.txt"
    lst.write_text("json/decoder.py\nno/such/file.py\nstring.py\n")
    prompts = bench.load_prompts(str(lst), 5)
    assert len(prompts) == 5 and {p["category"] for p in prompts} == {"heldout-code"}
    for p in prompts:
        rel, start = p["id"].rsplit("@", 1)
        assert rel in ("json/decoder.py", "string.py")          # the missing file is skipped, not guessed
        text = open(f"{root}/{rel}", encoding="utf-8").read()
        assert p["text"] == text[int(start):int(start) + 320] and (int(start) == 0 or text[int(start) - 1] == "\n")
    assert bench.load_prompts(str(lst), 5) == prompts            # seeded: the same windows every run
    lst.write_text("no/such/file.py\n")
    with pytest.raises(FileNotFoundError, match="none of its 1 held-out files"):
        bench.load_prompts(str(lst))


def test_allreduce_needs_torchrun():
    with pytest.raises(ValueError, match="needs torchrun"):
        bench.main(["allreduce", "--T", "1"])


def test_allreduce_under_torchrun_gloo(tmp_path):
    """The allreduce mode across 2 CPU ranks (gloo): every rank makes the same number of collectives (an adaptive
    timer would let them disagree and hang), prints on rank 0 only, and the processes exit cleanly."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "ar.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), "bench.py", "allreduce", "--device", "cpu", "--T", "1,9", "--out", str(out)],
                          cwd=os.path.dirname(bench.__file__), env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("## allreduce") == 1                 # rank 0 only
    res = json.loads(out.read_text())["allreduce"]
    assert res["world_size"] == 2 and [r["T"] for r in res["rows"]] == [1, 9]
    assert all(r["eager_us"] > 0 and r["graph_us"] is None for r in res["rows"])


# ----------------------------------------------------------------------------------------------
# --bound: the accept of a perfect drafter (the target drafting its own tree)

@pytest.fixture(scope="module")
def target():
    return tiny.random_model(tiny.text_config(), seed=3).eval()


def last_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]                                       # [V]


def test_oracle_tree_is_the_best_prefix_closed_set(target):
    """Depth 2, budget 6: the tree's path probabilities are the 6 best of all paths (brute force), in order."""
    ctx = [5, 17, 42, 8]
    p1 = verify.sampling_probs(last_logits(target, ctx), 1.0)                                  # [V]
    paths = {(a,): p1[a].item() for a in range(len(p1))}
    for a in p1.topk(6).indices.tolist():       # only a top-6 first token can lead a top-6 depth-2 path
        p2 = verify.sampling_probs(last_logits(target, ctx + [a]), 1.0)
        paths.update({(a, b): paths[(a,)] * p2[b].item() for b in range(len(p2))})
    best = sorted(paths.values(), reverse=True)[:6]
    parent, token, prob, logits = bench.oracle_tree(target, ctx, 6, 2, 1.0)
    assert len(token) == len(logits) == 7 and token[0] == ctx[-1] and prob[0] == 1.0
    assert prob[1:] == pytest.approx(best, rel=1e-5)
    assert all(0 <= parent[i] < i for i in range(1, 7))                                      # prefix-closed


def test_bound_greedy_commits_the_whole_chain(target):
    """Temperature 0: the tree is the greedy chain (depth min(B, L)), the walk takes all of it plus the bonus."""
    ctx = [3, 1, 4, 1, 5]
    parent, token, prob, _ = bench.oracle_tree(target, ctx, 8, 4, 0.0)
    greedy = []
    for _ in range(4):
        greedy.append(last_logits(target, ctx + greedy).argmax().item())
    assert parent == [-1, 0, 1, 2, 3] and token[1:] == greedy and prob == [1.0] * 5
    for budget, depth in ((1, 4), (3, 4), (4, 4), (8, 4), (8, 7)):
        steps = bench.oracle_decode(target, ctx, 30, budget, depth, 0.0, seed=0, max_seq_len=200)
        assert len(steps) >= 3 and all(s == (min(budget, depth) + 1, min(budget, depth) + 1) for s in steps)


def test_bound_budget_one_is_one_plus_max_prob(target):
    """Temperature 1, budget 1: the one node is the argmax, so E[accept] = 1 + max p (exactly, per step); the
    sampled accepts average to their expectations (budget 1 and 4)."""
    ctx = [7, 7, 2, 9]
    probs = verify.sampling_probs(last_logits(target, ctx), 1.0)                               # [V]
    parent, token, prob, _ = bench.oracle_tree(target, ctx, 1, 7, 1.0)
    assert parent == [-1, 0] and token[1] == probs.argmax().item() and prob[1] == pytest.approx(probs.max().item())
    for budget in (1, 4):
        steps = [s for seed in range(4) for s in bench.oracle_decode(target, [seed + 10, 20, 30], 80, budget, 7, 1.0,
                                                                     seed=seed, max_seq_len=250)]
        sampled, expected = sum(k for k, _ in steps) / len(steps), sum(e for _, e in steps) / len(steps)
        assert len(steps) > 100 and 1 < expected and abs(sampled - expected) < 0.1, (budget, sampled, expected)
        if budget == 1:
            assert all(1 < e < 2 for _, e in steps)


def test_e2e_bound(pair, capsys):
    res = bench.main(["e2e", "--device", "cpu", "--ckpt", str(pair / "target"), "--draft", str(pair / "draft"),
                      "--budgets", "1,4", "--n-prompts", "2", "--max-new-tokens", "10", "--warmup", "0",
                      "--no-chain", "--bound"])["e2e"]
    assert "drafter/bound" in capsys.readouterr().out
    L = res["block_size"] - 1
    for r in res["runs"]:
        if r["mode"] == "ddtree":
            assert 1 <= r["accept_bound"] <= min(r["budget"], L) + 1
            if r["temperature"] == 0:
                assert r["accept_bound"] == r["accept_bound_expected"] == min(r["budget"], L) + 1
        else:
            assert "accept_bound" not in r


def one_rank(tp: int, capsys, *extra) -> tuple[dict, str]:
    res = bench.main(["e2e", "--device", "cpu", "--ckpt", "random:tiny", "--one-rank-of", str(tp), "--budgets", "4",
                      "--ctx", "12", "--max-new-tokens", "2", "--temperature", "0", "--warmup", "0", *extra])
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1]) == json.loads(json.dumps(res))
    return res["e2e"], printed


def test_e2e_one_rank_of(capsys):
    """--one-rank-of 2 on random:tiny: rank 0's shapes, the real step with the collectives counted, not run. The
    counts per step follow from the configs: the target calls 1 + 2 per layer all-reduces (embedding; o_proj and
    the MLP/MoE of each layer) and 1 all-gather (lm_head); a DDTree step adds the drafter's 1 + 1 + 2 per layer
    (the target's embedding of the block, fc, o_proj and MLP of each layer) and 1 all-gather (the draft logits)."""
    originals = {n: getattr(torch.distributed, n) for n in bench.NOOP_COLLECTIVES}
    e, printed = one_rank(2, capsys, "--accept", "4.48,5.3", "--allreduce-us", "20,8.8", "--allreduce-gbps", "100")
    args, dargs = C.model_args("random:tiny"), C.draft_args("random:tiny-dflash")
    target_ar, draft_ar = 1 + 2 * args.num_hidden_layers, 2 + 2 * dargs.num_hidden_layers
    assert e["one_rank_of"] == 2 and e["collectives_run"] is False and e["draft"] == "random:tiny-dflash"
    assert "THE COLLECTIVES DID NOT RUN" in printed and "NOT MEASURED" in printed
    text = "\n".join(printed.strip().splitlines()[:-1])          # the printed report, the JSON line left out
    assert text.count(bench.COLLECTIVES_NOT_RUN) == 1 and e["statement"] == bench.COLLECTIVES_NOT_RUN
    assert "collectives did not run" in bench.COLLECTIVES_NOT_RUN
    rows = {r["mode"]: r for r in e["rows"]}
    assert [(r["ctx"], r["mode"], r["budget"]) for r in e["rows"]] == [(12, "ar", None), (12, "ddtree", 4)]
    assert (rows["ar"]["all_reduce"], rows["ar"]["all_gather"]) == (target_ar, 1)
    assert (rows["ddtree"]["all_reduce"], rows["ddtree"]["all_gather"]) == (target_ar + draft_ar, 2)
    for r in e["rows"]:
        calls = r["collective_calls"]
        assert r["collectives"] == r["all_reduce"] + r["all_gather"] == sum(v for k, v in calls.items()
                                                                             if not k.endswith("bytes"))
        assert r["collective_bytes"] == calls["all_reduce bytes"] + calls["all_gather bytes"] > 0
        assert r["steps"] >= 1 and close(r["ms_per_step"], 1e3 * r["decode_s"] / r["steps"]) and r["decode_s"] > 0
    proj = e["projection"]
    assert len(proj) == 2 * (1 + 2)            # per cost: AR at accept 1, DDTree at each --accept
    for p in proj:
        r = rows[p["mode"]]
        assert p["accept"] in ([1.0] if p["mode"] == "ar" else [4.48, 5.3]) and p["allreduce_us"] in (20.0, 8.8)
        ring_ms = r["collective_bytes"] * (2 * 1 / 2) / 100e9 * 1e3          # TP2: a ring moves 2(2-1)/2 x bytes
        assert close(p["comm_ms"], r["collectives"] * p["allreduce_us"] / 1e3 + ring_ms)
        assert close(p["step_ms"], r["ms_per_step"] + p["comm_ms"])
        assert close(p["tokens_per_s"], 1e3 * p["accept"] / (r["ms_per_step"] + p["comm_ms"]))
        assert close(p["tokens_per_s_no_comm"], 1e3 * p["accept"] / r["ms_per_step"])
    # the patch stays inside the mode
    assert M.world_size == 1 and M.rank == 0
    assert {n: getattr(torch.distributed, n) for n in bench.NOOP_COLLECTIVES} == originals


def test_e2e_one_rank_of_batch(capsys):
    """--batch with --one-rank-of: B synthetic prompts decoded together; the collectives' bytes grow with B (the
    all-reduced activations are [B, T, D]) and the projection counts B tokens per row's accept."""
    e, printed = one_rank(2, capsys, "--batch", "1,3", "--accept", "4")
    rows = {(r["batch"], r["mode"]): r for r in e["rows"]}
    assert sorted(rows) == [(1, "ar"), (1, "ddtree"), (3, "ar"), (3, "ddtree")] and e["batch"] == [1, 3]
    for mode in ("ar", "ddtree"):
        one, three = rows[1, mode], rows[3, mode]
        assert one["collectives"] == three["collectives"]
        assert three["collective_bytes"] > 2.5 * one["collective_bytes"]
    proj = {(p["batch"], p["mode"]): p for p in e["projection"]}
    for p in e["projection"]:
        r = rows[p["batch"], p["mode"]]
        assert close(p["tokens_per_s_no_comm"], 1e3 * p["accept"] * p["batch"] / r["ms_per_step"])
        # the break-even accept: a tree step committing that many tokens a row matches AR's tok/s at this batch
        ar = proj[p["batch"], "ar"]
        if p["mode"] == "ar":
            assert p["break_even_accept"] is None
        else:
            even = p["break_even_accept"]
            assert even > 0 and close(even, p["step_ms"] / ar["step_ms"])
            assert close(p["tokens_per_s"] * even / p["accept"], ar["tokens_per_s"])
    assert "batch" in printed and "pays above accept" in printed


def test_e2e_one_rank_of_auto(capsys):
    """--budgets auto with --one-rank-of: --budget auto's decode timed beside the fixed steps; its collectives per
    step are its steps' mix of the AR and the tree step's, and its projection takes the accept it measured."""
    e, printed = one_rank(2, capsys, "--budgets", "4,auto", "--max-new-tokens", "12", "--accept", "4")
    args, dargs = C.model_args("random:tiny"), C.draft_args("random:tiny-dflash")
    target_ar, draft_ar = 1 + 2 * args.num_hidden_layers, 2 + 2 * dargs.num_hidden_layers
    assert [r["mode"] for r in e["rows"]] == ["ar", "ddtree", "auto"]
    auto = e["rows"][-1]
    steps = {int(k): v for k, v in auto["budget_steps"].items()}
    assert auto["budget"] == "auto" and set(steps) <= {0, G.AUTO_BUDGET} and sum(steps.values()) == auto["steps"]
    trees = steps.get(G.AUTO_BUDGET, 0) / auto["steps"]
    assert trees > 0                                     # auto starts with trees (it knows nothing yet)
    assert close(auto["all_reduce"], target_ar + draft_ar * trees) and close(auto["all_gather"], 1 + trees)
    (p,) = [p for p in e["projection"] if p["mode"] == "auto"]
    assert p["accept"] == auto["mean_accept"] >= 1 and p["break_even_accept"] is None
    assert close(p["tokens_per_s_no_comm"], 1e3 * p["accept"] / auto["ms_per_step"])
    assert f"auto, ctx 12 batch 1: steps per budget {auto['budget_mix']}" in printed


def test_e2e_one_rank_of_1_has_no_collectives(capsys):
    e, _ = one_rank(1, capsys)
    assert [r["collectives"] for r in e["rows"]] == [0, 0] and all(r["collective_calls"] == {} for r in e["rows"])
    assert [r["collective_bytes"] for r in e["rows"]] == [0, 0]
    assert all(p["comm_ms"] == 0 and close(p["tokens_per_s"], p["tokens_per_s_no_comm"]) for p in e["projection"])


def test_one_step_count_is_what_each_decode_step_pays():
    """bench.step_collectives counts one eager step; a whole eager decode calls prefill's collectives, then
    exactly that many per step (AR and DDTree)."""
    original = torch.distributed.all_reduce
    with bench.collectives_not_run(2) as counts, torch.no_grad():
        assert torch.distributed.all_reduce is not original and M.world_size == 2
        target = C.random_model("random:tiny", "cpu", torch.float32)
        drafter = C.random_drafter("random:tiny-dflash", target.args, "cpu", torch.float32)
        assert target.lm_head.weight.shape[0] == target.args.vocab_size // 2     # rank 0's slice
        target.setup_cache(1, 64)
        drafter.setup_cache(1, 64)
        for budget in (0, 4):
            step = G.Step(target, drafter if budget else None, 1, budget, False, (0.0, 0, 1.0))
            counts.clear()
            step.prefill([list(range(2, 14))])
            prefill = counts.copy()
            per_step = bench.step_collectives(target, drafter, budget, (0.0, 0, 1.0), counts)
            counts.clear()
            st = G.Stats()
            G.generate(target, list(range(2, 14)), 3, drafter=drafter, budget=budget, max_seq_len=64, stats=st)
            steps = len(st.accept_lens)
            assert steps >= 1 and per_step["all_reduce"] > 0
            assert dict(counts) == {k: prefill[k] + steps * per_step[k] for k in per_step}
    assert M.world_size == 1 and torch.distributed.all_reduce is original


@pytest.mark.parametrize("value, message", [
    ("0", "--one-rank-of must be a tensor-parallel size >= 1, got 0"),
    ("-8", "--one-rank-of must be a tensor-parallel size >= 1, got -8"),
    ("2.5", "argument --one-rank-of: invalid int value: '2.5'"),
    ("3", "--one-rank-of 3: tensor parallel size 3 does not divide num_attention_heads=8"),
    ("16", "--one-rank-of 16: tensor parallel size 16 does not divide num_attention_heads=8")])
def test_one_rank_of_bad_values(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["e2e", "--ckpt", "random:tiny", "--one-rank-of", value])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(f": error: {message}")


def test_one_rank_of_bad_combinations(capsys):
    for argv, message in [(["layers", "--one-rank-of", "8"], "--one-rank-of: e2e only"),
                          (["e2e", "--one-rank-of", "8", "--accept", "0.5"], "--accept: tokens per step"),
                          (["e2e", "--one-rank-of", "8", "--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
                          (["layers", "--allreduce-us", "20,10"], "--allreduce-us: one cost"),
                          (["e2e", "--one-rank-of", "8", "--allreduce-gbps", "0"], "--allreduce-gbps: a finite"),
                          (["e2e", "--one-rank-of", "8", "--allreduce-gbps", "nan"], "--allreduce-gbps: a finite")]:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv + ["--ckpt", "random:tiny"])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_compiled_step_does_not_recompile_on_the_collective_counter():
    """Under collectives_not_run a torch.compile'd function that calls a collective compiles once: the no-op counts
    only eager calls (step_collectives counts the step eagerly), so dynamo has no counter to guard on."""
    import torch._dynamo as dynamo
    dynamo.reset()
    dynamo.utils.counters.clear()
    with bench.collectives_not_run(2) as counts:
        f = torch.compile(lambda x: (torch.distributed.all_reduce(x), x * 2)[1], backend="eager")
        for _ in range(4):
            assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
        assert dynamo.utils.counters["stats"]["unique_graphs"] == 1 and dict(counts) == {}
        torch.distributed.all_reduce(torch.ones(3))                  # an eager call is counted, with its bytes
        assert counts["all_reduce"] == 1 and counts["all_reduce bytes"] == 12
    dynamo.reset()


def test_kernels_resources_without_a_gpu(capsys):
    """kernels --resources compiles the MoE kernels and the skinny GEMM for sm_90
    on any machine with triton: each row names a kernel with its registers, and the tensor-core dots are wgmma
    (HGMMA), which W as the dot's rows is for."""
    pytest.importorskip("triton")
    rows = bench.main(["kernels", "--resources", "--device", "cpu"])["kernels"]["rows"]
    assert [r["kernel"] for r in rows] == [
        "GEMV gate | up", "GEMV down", "tensor-core gate | up", "tensor-core down", "skinny GEMM"]
    assert all(0 < r["registers"] <= 255 and r["stack_bytes"] >= 0 for r in rows)
    assert all(r["wgmma"] > 0 for r in rows[2:]) and all(r["wgmma"] == 0 for r in rows[:2])
    assert all(0 <= r["loop_lds"] < r["loop_instructions"] for r in rows)      # every kernel has its K loop
    assert "compiled for sm_90" in capsys.readouterr().out


def test_sass_main_loop_is_the_longest_innermost_loop():
    """The loop counted by kernels --resources: from a label to the last branch back to it, the longest such span
    with no loop inside (an outer loop's epilogue is not the K loop's; a forward branch to a label is no loop)."""
    listing = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDS R2, [R3] ;
.L_x_2:
        /*0020*/                   SHF.R.U32.HI R4, RZ, 0x4, R2 ;
        /*0030*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0040*/              @P0 BRA `(.L_x_2) ;
        /*0050*/              @!P1 LDS.U16 R6, [R3+0x2] ;
        /*0060*/                   BRA `(.L_x_1) ;
.L_x_4:
        /*0070*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0080*/              @P2 BRA `(.L_x_4) ;
        /*0090*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*00a0*/                   EXIT ;
"""
    loop = bench._sass_main_loop(listing)
    assert [i.split()[0] for i in loop] == ["SHF.R.U32.HI", "IADD3", "@P0"]
    assert bench._sass_main_loop("") == []
