"""Tensor parallelism on CPU with gloo: TP=2 and TP=4 logits == TP=1 (target and DFlash drafter), greedy
DDTree token streams identical across TP sizes (stub and real drafter), and each rank reads and holds only
its slice of the checkpoints.
Run: python -m pytest -q tests/test_tp.py"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import checkpoint as C
import cli
import draft as Dr
import model as M
import tiny

CFG = dict(moe_intermediate_size=128, intermediate_size=128)   # divisible by ws x group 32 up to TP=4
# drafter: 8 q heads / 4 kv heads (GQA groups of 2), intermediate 128, fc 2 x 64 columns: all split 4 ways;
# with biases, so the column-split and the rank-0-only row-parallel bias are exercised
DRAFT = dict(num_attention_heads=8, num_key_value_heads=4, attention_bias=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(r, ws, port, ckpt, draft_dir, out_dir, tokens):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ws), RANK=str(r),
                      LOCAL_RANK=str(r))
    torch.set_num_threads(1)
    cli.init_distributed(timeout_s=120, device="cpu")
    try:
        import generate as G
        from test_generate import StubDrafter
        torch.set_default_dtype(torch.float32)
        model = M.Transformer(C.model_args(ckpt))
        stats = C.load_checkpoint(model, ckpt)
        with torch.no_grad():
            logits = model(tokens).logits
        drafter = StubDrafter("random", model.args.vocab_size, seed=4)
        ids = G.generate(model, tokens[0, :5].tolist(), 20, drafter=drafter, budget=8, max_seq_len=64)
        out = {"logits": logits, "ids": ids, "bytes": stats["bytes_read"], **_drafter_run(model, draft_dir, tokens)}
        torch.save(out, os.path.join(out_dir, f"r{r}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _drafter_run(model, draft_dir, tokens) -> dict:
    """The real DFlash drafter loaded at this rank's TP size: its logits on the target's features, greedy DDTree
    ids (eager loop and fixed-shape steps; then --budget auto, whose choices every rank must share, else their
    collectives would not match), and this rank's parameter bytes (all / replicated ones)."""
    import generate as G
    d = C.load_drafter(draft_dir, model.args).eval()
    with torch.no_grad():
        _, feats = model(tokens[:, :-1], hidden_layers=d.target_layer_ids)             # [B, T-1, n_taps*D]
    d.setup_cache(tokens.shape[0], 32)
    B, n = feats.shape[:2]
    logits = d.draft_logits(model, tokens[:, -1], feats, torch.zeros(B, dtype=torch.long),
                            torch.full((B,), n))                                       # [B, bs-1, V]
    prompt = tokens[0, :5].tolist()
    ids = [G.generate(model, prompt, 12, drafter=d, budget=8, max_seq_len=64, mode=m) for m in ("eager", "static")]
    ids.append(G.generate(model, prompt, 30, drafter=d, budget="auto", max_seq_len=64))    # one-token stretches too
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)
    return {"draft_logits": logits, "draft_ids": ids, "draft_bytes": nbytes(d.parameters()),
            "draft_replicated": nbytes(p for p in d.parameters() if p.shard_dim is None)}


def _run_tp(ws, ckpt, draft_dir, out_dir, tokens):
    mp.start_processes(_worker, args=(ws, _free_port(), ckpt, draft_dir, str(out_dir), tokens), nprocs=ws,
                       start_method="spawn")
    return [torch.load(os.path.join(out_dir, f"r{r}.pt")) for r in range(ws)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_ckpt")
    tiny.write_k26(d, tiny.text_config(**CFG), seed=21)
    return str(d)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_draft")
    cfg = C.tiny_draft_config(C.model_args(tiny.text_config(**CFG)), **DRAFT)
    drafter = Dr.DFlashDrafter(C.draft_args(cfg))
    tiny.randomize_(drafter, seed=22, std=0.2)
    C.write_drafter(str(d), drafter, cfg, n_shards=2)
    return str(d)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def ref(ckpt, draft_dir, tokens, tmp_path_factory):
    """The TP=1 run, shared by every world size (spawning processes is most of the test time)."""
    return _run_tp(1, ckpt, draft_dir, tmp_path_factory.mktemp("tp1"), tokens)[0]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("ws", [2, 4])
def test_tp_matches_single_rank(ckpt, draft_dir, tokens, ref, tmp_path, ws):
    outs = _run_tp(ws, ckpt, draft_dir, tmp_path, tokens)
    assert ref["draft_ids"][0] == ref["draft_ids"][1] == ref["draft_ids"][2][:12]   # fixed-shape steps, auto == eager
    for o in outs:
        assert _rel_err(o["logits"], ref["logits"]) <= 1e-5
        assert _rel_err(o["draft_logits"], ref["draft_logits"]) <= 1e-5
        assert o["ids"] == ref["ids"]                    # every rank took the same decisions
        assert o["draft_ids"] == ref["draft_ids"]
    # each rank read about 1/ws of the sharded bytes (replicated norms/router/attention-a make it a bit more)
    for o in outs:
        assert o["bytes"] < ref["bytes"] / ws * 1.6, (o["bytes"], ref["bytes"])
    # the drafter: exactly 1/ws of every split tensor, plus the small replicated ones (norms, o_proj bias)
    rep = ref["draft_replicated"]
    assert rep < 0.01 * ref["draft_bytes"]
    for o in outs:
        assert o["draft_replicated"] == rep
        assert o["draft_bytes"] == (ref["draft_bytes"] - rep) // ws + rep, (o["draft_bytes"], ref["draft_bytes"])


def test_divisibility_checked_up_front():
    args = C.model_args(tiny.text_config())
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        M.check_tp_divisibility(args, 8)
    with pytest.raises(ValueError, match="moe_intermediate_size=32"):
        M.check_tp_divisibility(C.model_args(C.k26_config(tiny.text_config())), 2)
    dcfg = C.tiny_draft_config(args)                    # 4 q heads, 2 kv heads, intermediate 128
    dargs = C.draft_args(dcfg)
    with pytest.raises(ValueError, match="does not divide drafter num_key_value_heads=2"):
        M.check_tp_divisibility(dargs, 4)
    with pytest.raises(ValueError, match="drafter num_attention_heads=4"):
        M.check_tp_divisibility(dargs, 8)
    with pytest.raises(ValueError, match="drafter intermediate_size=129"):
        M.check_tp_divisibility(C.draft_args(dict(dcfg, intermediate_size=129)), 2)
    M.set_tp(4, 0)                                       # building the drafter checks before allocating
    try:
        with pytest.raises(ValueError, match="tensor parallel size 4 does not divide drafter num_key_value_heads"):
            Dr.DFlashDrafter(dargs)
    finally:
        M.set_tp(1, 0)


RANK_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import cli, model as M
cli.init_distributed(timeout_s=15, device="cpu")
if M.rank == 1:
    os._exit(3)                      # a rank dies without a word
try:
    x = torch.ones(4)
    dist.all_reduce(x)               # the survivor must not hang here
    dist.all_reduce(x)
    print("no error")
except Exception as e:
    print("error:", type(e).__name__)
    sys.exit(1)
"""


def test_dead_rank_is_an_error_not_a_hang(tmp_path):
    import subprocess
    import sys
    port = _free_port()
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=str(__import__("pathlib").Path(__file__).resolve().parents[1])))
    procs = []
    for r in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(r),
                   LOCAL_RANK=str(r), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out0, _ = procs[0].communicate(timeout=120)     # a hang would fail here
    procs[1].wait(timeout=30)
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0 and "error:" in out0, out0


def test_init_distributed_backend_follows_device(monkeypatch):
    """--device picks the torchrun backend: cpu -> gloo even on a GPU host (CUDA faked here), the default and
    "cuda" -> NCCL on this rank's GPU (LOCAL_RANK); one process joins nothing."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: calls.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(str(d)))
    monkeypatch.setattr(M, "world_size", M.world_size)          # restored afterwards
    monkeypatch.setattr(M, "rank", M.rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli.init_distributed(device="cpu") == torch.device("cpu") and calls == ["gloo"]
    assert (M.world_size, M.rank) == (2, 1)
    calls.clear()
    assert cli.init_distributed() == torch.device("cuda", 1) and calls == ["cuda:1", "nccl"]
    calls.clear()
    assert cli.init_distributed(device="cuda") == torch.device("cuda", 1) and calls == ["cuda:1", "nccl"]
    calls.clear()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.init_distributed(device="cpu") == torch.device("cpu") and calls == []
