"""Kimi K2.6's shapes with random weights, no checkpoint (checkpoint.random_model / random_drafter, --ckpt
random:<name>): every rank holds exactly the tensors the loaders would fill from a checkpoint, the same model at
every TP size (TP=2 logits == TP=1 logits over gloo), and greedy DDTree == greedy AR on the random pair.
Run: python -m pytest -q tests/test_random.py"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bench
import checkpoint as C
import cli
import draft as Dr
import generate as G
import model as M
import tiny

CFG = C.k26_config(tiny.text_config(moe_intermediate_size=128, intermediate_size=128))  # INT4, splits up to TP=4
DRAFT = C.tiny_draft_config(C.model_args(CFG), num_attention_heads=8, num_key_value_heads=4,
                             attention_bias=True)
F32 = torch.float32


def _pair(seed: int = 0):
    target = C.random_model(CFG, "cpu", F32, seed)
    return target, C.random_drafter(DRAFT, target.args, "cpu", F32, seed)


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].shape == pb[k].shape and pa[k].dtype == pb[k].dtype, k
        assert torch.equal(pa[k], pb[k]), k


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The TP=1 random pair written as checkpoints: the target in the K2.6 layout (its INT4 words as they are),
    the drafter in the DFlash one."""
    target, drafter = _pair()
    tdir, ddir = tmp_path_factory.mktemp("random_k26"), tmp_path_factory.mktemp("random_dflash")
    C.save_checkpoint(C.hf_state_dict(target, int4=True), CFG, str(tdir))
    C.write_drafter(str(ddir), drafter, DRAFT)
    return str(tdir), str(ddir)


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_each_rank_holds_what_the_loader_fills(written, ws):
    """Rank r's random model == the TP=1 random model written to disk and loaded by rank r: same parameter names,
    shapes, dtypes and values (so the random weights do not depend on the TP size)."""
    tdir, ddir = written
    try:
        for r in range(ws):
            M.set_tp(ws, r)
            loaded = M.Transformer(C.model_args(tdir))
            C.load_checkpoint(loaded, tdir)
            target, drafter = _pair()
            assert target.layers[1].mlp.experts.inter == 128 // ws
            _same_params(target, loaded)
            _same_params(drafter, C.load_drafter(ddir, loaded.args))
    finally:
        M.set_tp(1, 0)


def test_values_follow_the_seed_and_the_init_scale():
    a, b = C.random_model(CFG, "cpu", F32, seed=0), C.random_model(CFG, "cpu", F32, seed=1)
    assert not torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    w = a.layers[0].self_attn.o_proj.weight                       # [D, H v]: variance 1 / in_features
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1) < 0.05
    ex = a.layers[1].mlp.experts
    q = M.unpack_int4(ex.w13_packed)                              # random words: every nibble, equally often
    counts = torch.bincount((q.flatten() + 8).long(), minlength=16).float()
    assert counts.min() > 0.9 * counts.mean()
    w13 = M.dequant_int4(ex.w13_packed, ex.w13_scale, 32)          # [E, 2I, D]: about the float weights' scale
    assert 0.9 < w13.std().item() * w13.shape[-1] ** 0.5 < 1.2
    assert all(a.layers[i].input_layernorm.weight.eq(1).all() for i in range(3))
    with torch.no_grad():
        logits = a(torch.arange(10)[None]).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_values_do_not_depend_on_the_chunking():
    """randomize_ hashes a K2.6-sized tensor a chunk of rows at a time; the chunk size changes nothing."""
    view = torch.empty(5, 3, 4)
    whole = [h for _, h in C._element_hashes(view, (5, 6, 4), 1, key=123)]
    parts = [h for _, h in C._element_hashes(view, (5, 6, 4), 1, key=123, chunk=24)]
    assert len(whole) == 1 and len(parts) == 3 and torch.equal(whole[0], torch.cat(parts))
    assert whole[0].unique().numel() == 60 and 0 <= whole[0].min() and whole[0].max() < 2**32


def test_layers_bench_block_is_the_random_models_layer():
    """bench.py layers times layer i of the random model (rank 0's slice at its --tp)."""
    model = C.random_model(CFG, "cpu", F32, seed=3)
    _, block = bench.build_block(tiny.text_config(moe_intermediate_size=128, intermediate_size=128), 1, 1, "cpu",
                                 F32, seed=3)
    _same_params(block, model.layers[1])


def test_greedy_ddtree_equals_ar():
    target, drafter = _pair(seed=5)
    prompt, stats = [3, 14, 15, 92, 65], G.Stats()
    ar = G.generate(target, prompt, 24, max_seq_len=80)
    assert G.generate(target, prompt, 24, drafter=drafter, budget=32, max_seq_len=80, stats=stats) == ar
    assert max(stats.accept_lens) > 1           # some drafted token was accepted, not only the bonus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tokens: torch.Tensor) -> dict:
    """The random pair at this process's TP coordinates: target logits, draft logits, greedy DDTree and AR ids."""
    target, drafter = _pair(seed=7)
    with torch.no_grad():
        logits, feats = target(tokens, hidden_layers=drafter.target_layer_ids)
    drafter.setup_cache(tokens.shape[0], 32)
    B, n = tokens.shape[0], tokens.shape[1] - 1
    draft_logits = drafter.draft_logits(target, tokens[:, -1], feats[:, :-1], torch.zeros(B, dtype=torch.long),
                                        torch.full((B,), n))
    prompt = tokens[0].tolist()
    return {"logits": logits, "draft_logits": draft_logits, "ar": G.generate(target, prompt, 16, max_seq_len=64),
            "ddtree": G.generate(target, prompt, 16, drafter=drafter, budget=16, max_seq_len=64)}


def _worker(r, ws, port, tokens, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ws), RANK=str(r),
                      LOCAL_RANK=str(r))
    torch.set_num_threads(1)
    torch.set_default_dtype(F32)
    cli.init_distributed(timeout_s=120, device="cpu")
    try:
        torch.save(_run(tokens), os.path.join(out_dir, f"r{r}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.quick
def test_tp2_equals_tp1(tmp_path):
    """Each rank builds only its slice (no checkpoint, no communication while building), and TP=2 computes what
    TP=1 does: logits, draft logits, greedy tokens."""
    tokens = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(0))
    ref = _run(tokens)
    assert ref["ddtree"] == ref["ar"]
    mp.start_processes(_worker, args=(2, _free_port(), tokens, str(tmp_path)), nprocs=2, start_method="spawn")
    for r in range(2):
        out = torch.load(os.path.join(tmp_path, f"r{r}.pt"))
        for k in ("logits", "draft_logits"):
            assert ((out[k] - ref[k]).abs().max() / ref[k].abs().max()).item() <= 1e-5, k
        assert out["ar"] == ref["ar"] and out["ddtree"] == ref["ar"]


def test_real_size_per_rank_layout():
    """random:k2.6 at TP8 (on the meta device: shapes only): rank 5 holds 1/8 of every split tensor, all 384 INT4
    experts of all 60 MoE layers, and fits one H200 with room for the KV cache."""
    try:
        M.set_tp(8, 5)
        target = C.random_model("random:k2.6", "meta", torch.bfloat16)
        drafter = C.random_drafter("random:k2.6-dflash", target.args, "meta", torch.bfloat16)
    finally:
        M.set_tp(1, 0)
    assert len(target.layers) == 61 and len(drafter.layers) == 6
    ex = target.layers[60].mlp.experts                      # I = 2048 / 8 per rank, INT4 words of 8, groups of 32
    assert ex.w13_packed.shape == (384, 2 * 256, 7168 // 8) and ex.w13_packed.dtype == torch.int32
    assert ex.w13_scale.shape == (384, 2 * 256, 7168 // 32) and ex.w13_scale.dtype == torch.bfloat16
    assert ex.w2_packed.shape == (384, 7168, 256 // 8) and ex.w2_scale.shape == (384, 7168, 256 // 32)
    assert target.embed_tokens.weight.shape == (163840 // 8, 7168)
    assert target.layers[0].self_attn.n_heads == 8 and drafter.layers[0].self_attn.n_kv == 1
    nbytes = sum(p.numel() * p.element_size() for m in (target, drafter) for p in m.parameters())
    assert 60 * 2**30 < nbytes < 80 * 2**30, nbytes / 2**30


def test_cli(capsys):
    rc = cli.main(["--ckpt", "random:tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--budget", "4",
                 "--max-seq-len", "64", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and "random:tiny + drafter random:tiny-dflash" in out and "[3 tokens" in out
    assert out.count("<") >= 3                              # the ids, as <id>: no tokenizer covers a random model
    for argv, msg in [(["--ckpt", "random:k3"], "random:k3: no such random model (expected one of random:k2.6"),
                      (["--ckpt", "random:tiny", "--prompt", "hi"], "--ckpt random:tiny has no tokenizer")]:
        assert cli.main(argv + ["--prompt-ids", "1"] * ("--prompt" not in argv)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {msg}") and err.count("\n") == 1, err
    res = bench.main(["e2e", "--ckpt", "random:tiny", "--device", "cpu", "--budgets", "4", "--max-new-tokens", "4",
                      "--n-prompts", "1", "--temperature", "0", "--warmup", "0", "--no-chain"])["e2e"]
    assert res["draft"] == "random:tiny-dflash" and [r["lossless"] for r in res["runs"]] == [None, True]
