"""
Tests for train.py on CPU (< 90 s): a few stdlib files, a 512-token BPE, a tiny K2-architecture target.

    python -m pytest -q tests/test_train.py

Covers: the corpus split; the exported tiktoken.model reproduces the `tokenizers` BPE ids and round-trips
text; the target's loss falls; export -> load_checkpoint gives the in-memory model's logits (INT4 experts,
fp32 and bf16 exports); the dense training experts equal model.Experts.forward; the drafter's batched
training forward equals draft.py's inference forward at every anchor; a whole `train.main` run writes
loadable files, a log and a model card; soft labels are the target's next-token
distributions; --target-from reuses an exported target (and the log a killed run
leaves) without retraining it; the gpu preset fits TP 1/2/4/8, the kernels' shape rules and 25 MB.
"""
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint as C
import draft as dflash
import model as M
import tokenizer as tk
import train as TR
from tests.tiny import randomize_

P = dict(TR.PRESETS["test"], steps=30, log_every=5, eval_windows=8, qat_steps=5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(train texts, held-out texts, bpe, Tokenizer from the exported files, train ids, held-out ids)."""
    train_texts, val_texts, _ = TR.load_corpus(max_files=12)
    bpe = TR.train_bpe(train_texts, 512)
    out = tmp_path_factory.mktemp("tok")
    tok = TR.write_tokenizer(str(out), TR.bpe_ranks(bpe))
    return train_texts, val_texts, bpe, tok, TR.encode_corpus(tok, train_texts), TR.encode_corpus(tok, val_texts)


def test_corpus_split_is_stable_and_excludes_tests():
    root, rels = TR.stdlib_files()
    assert rels == sorted(rels) and len(rels) > 100
    assert not any(part in TR.EXCLUDE_DIRS for r in rels for part in r.split("/")[:-1])
    held = [r for r in rels if TR.is_heldout(r)]
    assert 0.02 < len(held) / len(rels) < 0.1                        # about 1 in 20
    # pinned: a hash of the path, so the split cannot drift with the Python version or file order
    names = ["_sitebuiltins.py", "asyncio/events.py", "codecs.py", "json/decoder.py", "os.py", "typing.py"]
    assert [n for n in names if TR.is_heldout(n)] == ["_sitebuiltins.py", "asyncio/events.py", "codecs.py"]


def test_tokenizer_export_matches_bpe(corpus):
    train_texts, val_texts, bpe, tok, _, _ = corpus
    n = tok.num_base_tokens
    assert n == 512 and tok.vocab_size == n + 256 and tok.vocab_size % 8 == 0
    assert (tok.bos_id, tok.eos_id, tok.id_of("[UNK]")) == (n, n + 1, n + 254)
    samples = [t[:3000] for t in val_texts] + [train_texts[0][-2000:], "x = 'café 世界 🙂'\n\tif a<=b: pass  \n"]
    for text in samples:
        ids = tok.encode(text, allow_special=False)
        assert ids == bpe.encode(text).ids                          # tiktoken ranks replay the BPE merges
        assert tok.decode(ids) == text                              # byte-level: lossless round trip
    assert tok.encode("<|im_end|>") == [tok.im_end_id]             # K2 special tokens right after the vocab


def _target(corpus, seed=0, **over):
    torch.manual_seed(seed)
    cfg = TR.target_config(dict(P, **over), corpus[3].num_base_tokens)
    model = M.Transformer(C.model_args(cfg))
    TR.init_weights_(model, P["layers"])
    return model, cfg


def test_target_loss_falls_and_export_roundtrips(corpus, tmp_path):
    train, val = corpus[4], corpus[5]
    model, cfg = _target(corpus)
    log = {}
    TR.train_target(model, train, val, P, torch.device("cpu"), log)
    curve = log["target"]
    assert curve["loss"][-1] < curve["loss"][0] - 0.5, curve["loss"]
    assert curve["val_loss"][-1] < 6.0                              # ln(768) = 6.64 at chance
    with torch.no_grad():                                           # make the router bias matter in the check
        for layer in model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    x = val[:65].view(1, -1)

    # fp32 export: the loaded model equals the in-memory one whose experts are rounded to INT4
    M.set_tp(1, 0)
    TR.export_target(model, cfg, str(tmp_path / "fp32"), dtype=torch.float32)
    loaded = TR.load_target(str(tmp_path / "fp32"), "cpu", torch.float32)
    assert loaded.args.quant is not None and loaded.args.nested
    with torch.no_grad(), TR.expert_forward(model, int4=(torch.float32, torch.float32)):
        ref = model(x).logits
    torch.testing.assert_close(loaded(x).logits, ref, atol=2e-4, rtol=1e-4)

    # bf16 export (what ships): the same after rounding every in-memory weight to bf16
    TR.export_target(model, cfg, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    loaded = TR.load_target(str(tmp_path / "bf16"), "cpu", torch.float32)
    files = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(files.values())) == 3 and any(k.endswith("experts.0.up_proj.weight_packed") for k in files)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "e_score_correction_bias" not in name:
                p.copy_(p.to(torch.bfloat16).float())
        with TR.expert_forward(model, int4=(torch.bfloat16, torch.float32)):
            ref = model(x).logits
    torch.testing.assert_close(loaded(x).logits, ref, atol=2e-4, rtol=1e-4)


def test_dense_experts_equal_reference():
    torch.manual_seed(0)
    N, D, I, E, k = 40, 32, 16, 8, 2
    x = torch.randn(N, D, requires_grad=True)
    w13, w2 = torch.randn(E, 2 * I, D, requires_grad=True), torch.randn(E, D, I, requires_grad=True)
    scores = torch.rand(N, E, requires_grad=True)
    ids = torch.rand(N, E).topk(k, dim=-1)[1]
    outs = []
    loop = lambda x, ids, w, w13, w2: M.Experts.forward.ref(types.SimpleNamespace(expert=lambda e: (w13[e], w2[e])),
                                                              x, w, ids)
    for fn in (loop, TR.experts_dense):
        y = fn(x, ids, scores.gather(1, ids), w13, w2)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, D)).sum(), (x, w13, w2, scores))
        outs.append((y, *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    model = M.Transformer(C.model_args(TR.target_config(P, 256)))
    randomize_(model)
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad(), TR.expert_forward(model, dense=True):
        dense = model(tokens).logits
    torch.testing.assert_close(dense, model(tokens).logits.detach(), atol=1e-4, rtol=1e-4)   # after the swap is undone


def _random_pair(corpus, layers: int, draft_layers: int):
    """A randomized tiny target and its drafter (train.py's configs)."""
    torch.manual_seed(0)
    target, _ = _target(corpus, layers=layers)
    randomize_(target, seed=1)
    dcfg = TR.drafter_config(dict(P, draft_layers=draft_layers), target.args, corpus[3].num_base_tokens)
    drafter = dflash.DFlashDrafter(C.draft_args(dcfg))
    randomize_(drafter, seed=2)
    return target, drafter


def test_drafter_train_forward_equals_inference(corpus):
    target, drafter = _random_pair(corpus, layers=4, draft_layers=2)
    assert drafter.mask_token_id == corpus[3].id_of("[UNK]") and drafter.block_size == 8
    tokens = corpus[5][:2 * 48].view(2, 48)
    anchors = torch.tensor([[1, 9, 20, 40], [3, 4, 17, 33]])      # overlapping blocks must not see each other
    with torch.no_grad():
        _, feats = target(tokens, hidden_layers=tuple(drafter.target_layer_ids))
        h = TR.drafter_train_forward(drafter, target.embed_tokens, feats, tokens, anchors)   # [B, A, bs, D]
        drafter.setup_cache(1, 64)
        for b in range(2):
            for i, a in enumerate(anchors[b].tolist()):
                block = torch.full((1, 8), drafter.mask_token_id)
                block[0, 0] = tokens[b, a]
                ctx_len, n_valid = torch.tensor([0]), torch.tensor([a])                   # context = positions < a
                ref = drafter.cached_forward(target.embed_tokens(block), feats[b:b + 1, :a], ctx_len, n_valid)
                torch.testing.assert_close(h[b, i], ref[0], atol=1e-5, rtol=1e-5)
    # gradients reach the drafter only (the target and its shared embedding / lm_head stay frozen)
    target.requires_grad_(False)
    loss, acc = TR.drafter_loss(drafter, target, tokens, anchors)
    loss.backward()
    assert acc.shape == (7,) and all(p.grad is not None for p in drafter.parameters())


def test_soft_labels_are_the_targets_next_token_distribution(corpus):
    """On soft rows the drafter's loss is the cross-entropy against the target's distribution over each label
    token given every token before it (checked against separate prefix forwards); on hard rows it is the corpus
    tokens'. Sampled rollouts continue the window with tokens the target can produce."""
    target, drafter = _random_pair(corpus, layers=2, draft_layers=1)
    seqs = TR.rollouts(target, corpus[5], 2, 8, 24, 2, torch.Generator().manual_seed(0), "cpu", temperature=1.0)
    assert seqs.shape == (2, 32) and int(seqs.max()) < target.args.vocab_size
    target.kv_cache = None                      # rollouts set up a cache: full forwards below
    anchors = torch.tensor([[9, 20], [12, 16]])
    with torch.no_grad():
        hard, _ = TR.drafter_loss(drafter, target, seqs, anchors)
        soft, _ = TR.drafter_loss(drafter, target, seqs, anchors, soft=torch.tensor([True, True]))
        _, feats = target(seqs, hidden_layers=tuple(drafter.target_layer_ids))
        h = TR.drafter_train_forward(drafter, target.embed_tokens, feats, seqs, anchors)
        q = target.head(h[:, :, 1:]).log_softmax(-1)                                # [B, A, 7, V]
        w = torch.exp(-torch.arange(7) / 4.0)
        ref = 0.0
        for b in range(2):
            for i, a in enumerate(anchors[b].tolist()):
                for k in range(1, 8):
                    p = target(seqs[b:b + 1, :a + k]).logits[0, -1].softmax(-1)     # the label's distribution
                    ref += -(p * q[b, i, k - 1]).sum() * w[k - 1]
    torch.testing.assert_close(soft, ref / 4 / w.sum(), atol=1e-4, rtol=1e-4)
    assert not torch.isclose(soft, hard)


MAIN_ARGS = ["--preset", "test", "--steps", "6", "--draft-steps", "4", "--max-files", "12"]
STAGES = {"corpus", "tokenizer", "target", "drafter", "distill", "eval"}


def _main(out, *extra: str) -> dict:
    """train.main on the test preset cut to seconds; every run gets the same overrides (eval_windows feeds
    val_exported, which the --target-from tests compare across runs)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TR.PRESETS, "test", dict(TR.PRESETS["test"], qat_steps=3, eval_windows=4))
        return TR.main(TR.parse_args(["--out", str(out), *MAIN_ARGS, *extra]))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(out dir, results) of one whole train.main run, shared by the tests that need a trained target."""
    out = tmp_path_factory.mktemp("main")
    return out, _main(out)


def test_main_end_to_end(first_run):
    out, r = first_run
    for f in ["train_log.json", "model_card.md", "heldout_files.txt", "tiny-k2/config.json",
              "tiny-k2/tiktoken.model", "tiny-k2/tokenizer_config.json", "tiny-k2/generation_config.json",
              "tiny-k2-dflash/config.json", "tiny-k2-dflash/model.safetensors"]:
        assert (out / f).is_file(), f
    log = json.loads((out / "train_log.json").read_text())
    assert set(log) >= {"target", "qat", "drafter", "results"} and len(log["target"]["loss"]) >= 1
    assert r["accept"]["ddtree_b8"] >= 1.0 and r["total_bytes"] < 25e6
    assert set(r["stage_seconds"]) == STAGES and all(s >= 0 for s in r["stage_seconds"].values())
    assert "n/a" not in (out / "model_card.md").read_text()
    tok = tk.Tokenizer.from_dir(out / "tiny-k2")
    assert tok.vocab_size == C.model_args(str(out / "tiny-k2")).vocab_size


def _same_files(a: Path, b: Path) -> None:
    assert sorted(f.name for f in a.iterdir()) == sorted(f.name for f in b.iterdir())
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def test_target_from_reuses_exported_target(first_run, tmp_path, monkeypatch):
    """--target-from: no target or BPE training; the same target files, figures and log; the same drafter as the
    one-call run (its init is reseeded, and CPU training is deterministic)."""
    first, r1 = first_run
    for name in ("train_bpe", "train_target", "export_target"):
        monkeypatch.setattr(TR, name, lambda *a, name=name, **kw: pytest.fail(f"--target-from ran {name}"))
    # other --max-files / --steps: the earlier run's win (its held-out split, the card's description of its training)
    r = _main(tmp_path, "--max-files", "10", "--steps", "99", "--target-from", str(first / "tiny-k2"))
    _same_files(first / "tiny-k2", tmp_path / "tiny-k2")
    _same_files(first / "tiny-k2-dflash", tmp_path / "tiny-k2-dflash")
    assert abs(r["val_exported"] - r1["val_exported"]) < 1e-6
    assert set(r["stage_seconds"]) == STAGES and r["target_from"] == str(first / "tiny-k2")
    assert {k: r[k] for k in TR.TARGET_RESULTS} == {k: r1[k] for k in TR.TARGET_RESULTS}
    log1, log = (json.loads((d / "train_log.json").read_text()) for d in (first, tmp_path))
    assert log["target"] == log1["target"] and log["qat"] == log1["qat"] and "drafter" in log
    assert (log["config"]["max_files"], log["config"]["steps"]) == (12, 6)
    assert "n/a" not in (tmp_path / "model_card.md").read_text()


def test_killed_run_leaves_target_log_and_resumes_in_place(tmp_path, monkeypatch):
    """The GPU workflow: call 1 is killed in the drafter steps but leaves train_log.json; call 2 passes
    --target-from <out>/tiny-k2 with the same --out (nothing copied) and gets the target's figures from it."""
    def killed(*args, **kw):
        raise KeyboardInterrupt
    with monkeypatch.context() as mp:
        mp.setattr(TR, "train_drafter", killed)
        with pytest.raises(KeyboardInterrupt):
            _main(tmp_path)
    log = json.loads((tmp_path / "train_log.json").read_text())
    partial = log["results"]
    assert set(partial) >= {*TR.TARGET_RESULTS, "val_exported"} and "drafter" not in log
    assert set(partial["stage_seconds"]) == {"corpus", "tokenizer", "target"}
    target_files = {f.name: f.read_bytes() for f in (tmp_path / "tiny-k2").iterdir()}
    r = _main(tmp_path, "--target-from", str(tmp_path / "tiny-k2"))
    assert {f.name: f.read_bytes() for f in (tmp_path / "tiny-k2").iterdir()} == target_files
    assert {k: r[k] for k in TR.TARGET_RESULTS} == {k: partial[k] for k in TR.TARGET_RESULTS}
    assert abs(r["val_exported"] - partial["val_exported"]) < 1e-6
    assert json.loads((tmp_path / "train_log.json").read_text())["target"] == log["target"]


def test_target_from_without_log(first_run, tmp_path):
    """No train_log.json next to DIR: the parameter count is recomputed, the other target figures are n/a; a
    preset whose target differs from DIR's is refused."""
    first, r1 = first_run
    src = tmp_path / "bare" / "tiny-k2"
    shutil.copytree(first / "tiny-k2", src)
    r = _main(tmp_path / "out", "--target-from", str(src))
    assert r["target_params"] == r1["target_params"] and abs(r["val_exported"] - r1["val_exported"]) < 1e-6
    assert not any(k in r for k in ("val_float", "val_ptq", "val_qat", "qat_kept", "train_final"))
    card = (tmp_path / "out" / "model_card.md").read_text()
    assert "| float | n/a |" in card and "training figures n/a" in card
    with pytest.raises(ValueError, match="differs from the cpu preset's target"):
        TR.main(TR.parse_args(["--out", str(tmp_path / "cpu"), "--preset", "cpu", "--max-files", "12",
                               "--target-from", str(src)]))


def test_target_from_rejects_a_dir_that_is_not_an_export(tmp_path):
    for bad, why in [(tmp_path / "nowhere", "no such directory"), (tmp_path, "no config.json")]:
        with pytest.raises(ValueError, match=why) as e:
            TR.main(TR.parse_args(["--out", str(tmp_path / "out"), *MAIN_ARGS, "--target-from", str(bad)]))
        assert str(bad) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()                         # refused before any work


def test_gpu_preset_fits_tp_kernels_and_size_budget():
    p = TR.PRESETS["gpu"]
    args = C.model_args(TR.target_config(p, p["bpe_vocab"]))
    for ws in (1, 2, 4, 8):
        M.check_tp_divisibility(args, ws)                           # raises if a TP size cannot split it
    for n in (args.kv_lora_rank, args.qk_rope_head_dim):            # kernels.mla_attention's rule
        assert n >= 16 and n & (n - 1) == 0
    with torch.device("meta"):
        target = M.Transformer(args)
        drafter = dflash.DFlashDrafter(C.draft_args(TR.drafter_config(p, args, p["bpe_vocab"])))
    experts = sum(t.numel() for n, t in target.named_parameters() if ".experts." in n)
    dense = sum(t.numel() for t in target.parameters()) - experts + sum(t.numel() for t in drafter.parameters())
    size = 2 * dense + experts * (0.5 + 2 / TR.GROUP)              # bf16; INT4 + one bf16 scale per group
    assert size < 0.95 * TR.SIZE_BUDGET, size
