"""
Train the bundled tiny Kimi-K2.6-architecture model and its DFlash drafter, from nothing but the Python
standard library's source code, and write them in the exact K2.6 / DFlash file layouts.

    python train.py --out checkpoints                  # the shipped recipe (preset gpu: ~9 min on one H200)
    python train.py --out /tmp/tiny --preset cpu       # smaller: about 25 minutes on 2 CPU cores
    python train.py --out /tmp/tt --preset test        # a smoke run in about a minute
    (--steps / --draft-steps / --max-files override a preset)
    python train.py --out checkpoints --target-from checkpoints/tiny-k2   # steps 3-4 done by an earlier run

--target-from DIR skips steps 3-4 (and the BPE training of step 2): the target an earlier run exported to DIR is
copied, its tokenizer encodes the corpus, and DIR/../train_log.json (written as soon as the target is exported)
supplies the target's settings and figures. On a GPU whose calls are time-limited, one call trains the target and
the next the drafter; r['stage_seconds'] says how long each step took.

Writes <out>/tiny-k2/ (config.json, INT4 pack-quantized shards + index, tiktoken.model, tokenizer_config.json,
chat_template.jinja, generation_config.json), <out>/tiny-k2-dflash/ (config.json, model.safetensors), and
<out>/train_log.json (loss curves), <out>/heldout_files.txt, <out>/model_card.md. With --out checkpoints, generate.py
serves them with no flags.

Steps: 1 corpus, 2 tokenizer, 3 target, 4 INT4 export, 5 drafter, 6 evaluation (numbered below).
Invariants:
  * training and serving tokenize identically: the corpus is encoded by tokenizer.Tokenizer (tiktoken, K2
    regex) from the exported files, and the tiktoken ranks reproduce the `tokenizers` BPE ids exactly;
  * the drafter trains against the exported INT4 target loaded back with load_checkpoint (what serves);
  * the drafter's training forward (all anchors in one pass, block attention mask) equals draft.py's
    inference forward at every anchor (tests/test_train.py);
  * fixed seeds; held-out files chosen by a hash of their path (stable across Python versions, though the
    corpus itself is whatever standard library the running interpreter has).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import checkpoint as C
import draft as dflash
import files
from cli import check_device, check_ranges, exit_code
import model as M
import tokenizer as tk
import verify

TARGET_DIR, DRAFT_DIR = "tiny-k2", "tiny-k2-dflash"   # the names generate.py looks for under checkpoints/
GROUP = 32                                            # INT4 group size (K2.6)
SIZE_BUDGET = 25e6                                    # bytes on disk: target + tokenizer + drafter

PRESETS = {
    # tokenizer | target shape (MLA ranks, MoE) | ctx = training context = YaRN original_max_position_embeddings
    # | target training (then steps // 10 quantization-aware steps) | drafter | evaluation.
    # bias_u: router-bias step of the load balancing. DeepSeek-V3 used 1e-3 over ~1e5 steps; ours are ~1e3
    # steps, so 10x faster (with 1e-3 the routing stays collapsed onto 2 experts for hundreds of steps).
    "cpu": dict(bpe_vocab=4096,
                dim=128, layers=4, heads=8, q_lora=64, kv_lora=32, nope=16, rope=16, v=16, dense_inter=384,
                moe_inter=128, experts=8, topk=2, ctx=128,
                batch=16, steps=2500, lr=3e-3, bias_u=1e-2,
                draft_layers=2, draft_inter=384, draft_steps=2000, draft_batch=8, anchors=16, draft_lr=2e-3,
                max_files=0, eval_windows=256, log_every=50, eval_prompts=4,
                distill_rollouts=8192, distill_sampled=1 / 3, distill_steps=1500),
    "test": dict(bpe_vocab=512,
                 dim=64, layers=2, heads=4, q_lora=32, kv_lora=32, nope=16, rope=16, v=16, dense_inter=128,
                 moe_inter=32, experts=8, topk=2, ctx=64,
                 batch=8, steps=40, lr=3e-3, bias_u=1e-2,
                 draft_layers=1, draft_inter=128, draft_steps=30, draft_batch=4, anchors=4, draft_lr=3e-3,
                 max_files=24, eval_windows=16, log_every=10, eval_prompts=1,
                 distill_rollouts=64, distill_sampled=0.5, distill_steps=5),
}
# gpu: the cpu preset's small target with twice its context and more drafter training. A first trial on an H200
# with a 4x larger target (dim 256, 6 layers, 3000 x 32 x 256 tokens) overfit the ~2M-token corpus: held-out
# loss bottomed at 3.75 (step 1000) and ended at 4.39 while the training loss fell to 0.94.
PRESETS["gpu"] = dict(PRESETS["cpu"], ctx=256, draft_layers=3, draft_steps=1500, log_every=100,
                      distill_rollouts=24576, rollout_batch=256, distill_steps=6000)

# -----------------------------------------------------------------------------------------------
# 1. Corpus: the running interpreter's standard library, minus test suites and generated tables.

EXCLUDE_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data", "encodings",
                "site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 200_000


def stdlib_files(root: str | None = None) -> tuple[Path, list[str]]:
    """(root, sorted relative paths of the *.py files we train on)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    rels = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDE_DIRS.isdisjoint(rel.parts[:-1]) and not rel.parts[0].startswith("config-") \
                and p.stat().st_size <= MAX_FILE_BYTES:
            rels.append(rel.as_posix())
    return root, sorted(rels)


def is_heldout(rel: str, every: int = 20) -> bool:
    """About 1 file in `every`, picked by a hash of the relative path: the same file is held out on any
    Python version that has it, whatever else was added or removed."""
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % every == 0


def load_corpus(max_files: int = 0) -> tuple[list[str], list[str], list[str]]:
    """(train texts, held-out texts, held-out relative paths). max_files > 0 keeps a small even sample."""
    root, rels = stdlib_files()
    if max_files:
        rels = rels[::max(1, len(rels) // max_files)][:max_files]
        held = [r for r in rels if is_heldout(r, 8)] or rels[-1:]   # a tiny sample still needs a held-out file
    else:
        held = [r for r in rels if is_heldout(r)]
    read = lambda r: (root / r).read_text(encoding="utf-8", errors="replace")
    return [read(r) for r in rels if r not in held], [read(r) for r in held], held

# -----------------------------------------------------------------------------------------------
# 2. Tokenizer: byte-level BPE trained with `tokenizers` (same K2 pre-tokenizer regex), exported as a
# Kimi tiktoken.model. Ranks = the BPE's own ids: 256 single bytes first, then merges in training order;
# tiktoken merges by lowest rank of the merged bytes, which replays the BPE merges.


def byte_unicode_map() -> dict[str, int]:
    """GPT-2's ByteLevel alphabet: printable char -> the raw byte it stands for."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def train_bpe(texts: list[str], vocab_size: int):
    """A `tokenizers` byte-level BPE, pre-tokenized by the K2 regex (Oniguruma accepts its `&&` classes)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(tk.PAT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    return bpe


def bpe_ranks(bpe) -> dict[bytes, int]:
    u2b = byte_unicode_map()
    ranks = {bytes(u2b[ch] for ch in s): i for s, i in bpe.get_vocab().items()}
    assert sorted(ranks.values()) == list(range(len(ranks))), "BPE ids are not contiguous"
    assert all(len(t) == 1 for t, r in ranks.items() if r < 256), "ranks 0..255 must be the single bytes"
    return ranks


def write_tokenizer(out_dir: str, ranks: dict[bytes, int]) -> tk.Tokenizer:
    """tiktoken.model + tokenizer_config.json (K2 special ids right after the BPE vocab) + chat_template.jinja (the
    K2.6 chat format) + generation_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    n = len(ranks)
    tk.write_tiktoken_model(os.path.join(out_dir, "tiktoken.model"), ranks)
    tk.write_tokenizer_config(os.path.join(out_dir, "tokenizer_config.json"), tk.KIMI_SPECIAL_TOKENS(n))
    tk.write_chat_template(out_dir)
    gen = {"bos_token_id": n, "eos_token_id": n + 1, "pad_token_id": n + 255, "do_sample": False}
    files.write_json(os.path.join(out_dir, "generation_config.json"), gen)
    return tk.Tokenizer.from_dir(out_dir)


def encode_corpus(tok: tk.Tokenizer, texts: list[str]) -> torch.Tensor:
    """One stream: [BOS] file [EOS] [BOS] file [EOS] ... (special-looking text stays plain text)."""
    ids: list[int] = []
    for t in texts:
        ids += [tok.bos_id] + tok.encode(t, allow_special=False) + [tok.eos_id]
    return torch.tensor(ids, dtype=torch.long)

# -----------------------------------------------------------------------------------------------
# 3. Target: a small K2-architecture model (MLA, YaRN, 1 dense layer, sigmoid-routed MoE + shared expert).


def target_config(p: dict, num_base: int) -> dict:
    ctx = p["ctx"]
    return dict(model_type="kimi_k2", vocab_size=num_base + tk.NUM_RESERVED_SPECIAL_TOKENS, hidden_size=p["dim"],
                intermediate_size=p["dense_inter"], moe_intermediate_size=p["moe_inter"],
                num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["heads"],
                q_lora_rank=p["q_lora"], kv_lora_rank=p["kv_lora"], qk_nope_head_dim=p["nope"],
                qk_rope_head_dim=p["rope"], v_head_dim=p["v"], n_routed_experts=p["experts"],
                num_experts_per_tok=p["topk"], n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
                n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                routed_scaling_factor=2.827, rms_norm_eps=1e-5, rope_theta=50000.0,
                rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=ctx, beta_fast=32.0,
                                  beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                max_position_embeddings=4 * ctx, tie_word_embeddings=False, bos_token_id=num_base,
                eos_token_id=num_base + 1, pad_token_id=num_base + 255, num_nextn_predict_layers=0,
                hidden_act="silu", attention_bias=False, torch_dtype="bfloat16")


def init_weights_(module: torch.nn.Module, n_layers: int, std: float = 0.02) -> None:
    """Norms 1, router bias 0, matrices N(0, std); residual-branch outputs scaled by 1/sqrt(2 n_layers) (GPT-2)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "e_score_correction_bias" in name or name.endswith(".bias"):
                p.zero_()
            else:
                out = name.endswith(("o_proj.weight", "down_proj.weight", "w2"))
                p.normal_(0.0, std / math.sqrt(2 * n_layers) if out else std)


def get_batch(data: torch.Tensor, B: int, T: int, gen: torch.Generator, device) -> torch.Tensor:
    """B random windows of T+1 tokens -> [B, T+1] (inputs = [:, :-1], next-token targets = [:, 1:])."""
    ix = torch.randint(len(data) - T - 1, (B,), generator=gen)
    return torch.stack([data[i:i + T + 1] for i in ix.tolist()]).to(device)


def autocast(device, enabled: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (for fp32 master weights), plain fp32 on CPU."""
    if device.type == "cuda" and enabled:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def make_optimizer(module: torch.nn.Module, lr: float, wd: float) -> torch.optim.AdamW:
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=fused)


def track_expert_load(model: M.Transformer) -> tuple[dict[int, torch.Tensor], list]:
    """Count, per MoE layer, how many tokens each routed expert received in training forwards.
    Returns (loads, hook handles: .remove() them when done)."""
    loads, handles = {}, []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, M.MoE):
            gate = layer.mlp.gate
            gate.e_score_correction_bias.requires_grad_(False)    # never trained by gradients
            loads[i] = torch.zeros(gate.weight.shape[0], device=gate.weight.device)

            def hook(m, inp, out, i=i):
                if m.training:
                    loads[i] += torch.bincount(out[1].flatten(), minlength=loads[i].numel())
            handles.append(gate.register_forward_hook(hook))
    return loads, handles


@torch.no_grad()
def balance_experts_(model: M.Transformer, loads: dict[int, torch.Tensor], u: float) -> float:
    """DeepSeek-V3's auxiliary-loss-free balancing: the selection bias of an overloaded expert goes down by u,
    of an underloaded one up by u (the bias only picks experts; the mixing weights stay the raw scores).
    Returns the worst layer's max/mean load, 1.0 = perfectly balanced."""
    worst = 1.0
    for i, load in loads.items():
        model.layers[i].mlp.gate.e_score_correction_bias += u * torch.sign(load.mean() - load)
        worst = max(worst, float(load.max() / load.mean().clamp(min=1)))
        load.zero_()
    return worst


def lm_loss(model: M.Transformer, xy: torch.Tensor) -> torch.Tensor:
    logits = model(xy[:, :-1]).logits                                               # [B, T, V] fp32
    return F.cross_entropy(logits.flatten(0, 1), xy[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: M.Transformer, data: torch.Tensor, T: int, max_windows: int, device, batch: int = 16) -> float:
    """Mean next-token loss over the first max_windows non-overlapping windows of a held-out stream."""
    n = min(max_windows, (len(data) - 1) // T)
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, n, batch):
        xy = torch.stack([data[j * T:j * T + T + 1] for j in range(i, min(n, i + batch))]).to(device)
        with autocast(device, enabled=model.embed_tokens.weight.dtype == torch.float32):   # bf16 model: as served
            total += lm_loss(model, xy).item() * xy.shape[0]
    model.train(was_training)
    return total / n


def train_target(model, train, val, p, device, log, steps=None, lr=None, tag="target") -> None:
    """Next-token training on random windows: AdamW, warmup + cosine, grad clip 1, router bias balancing."""
    steps, lr = steps or p["steps"], lr or p["lr"]
    opt = make_optimizer(model, lr, wd=0.1)
    loads, hooks = track_expert_load(model)
    gen = torch.Generator().manual_seed(1 if tag == "target" else 2)
    curve = log.setdefault(tag, {"step": [], "loss": [], "val_step": [], "val_loss": [], "imbalance": []})
    model.train()
    t0, acc, imb = time.time(), 0.0, 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=min(100, steps // 10))
        xy = get_batch(train, p["batch"], p["ctx"], gen, device)
        with autocast(device):
            loss = lm_loss(model, xy)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imb += balance_experts_(model, loads, u=p["bias_u"])
        acc += loss.item()
        if (step + 1) % p["log_every"] == 0 or step == steps - 1:
            k = (step % p["log_every"]) + 1
            curve["step"].append(step + 1)
            curve["loss"].append(acc / k)
            curve["imbalance"].append(imb / k)
            msg = f"{tag} step {step + 1}/{steps}: loss {acc / k:.3f}, expert load max/mean {imb / k:.2f}"
            if (step + 1) % (5 * p["log_every"]) == 0 or step == steps - 1:
                curve["val_step"].append(step + 1)
                curve["val_loss"].append(evaluate(model, val, p["ctx"], p["eval_windows"], device))
                msg += f", held-out {curve['val_loss'][-1]:.3f}"
            print(f"{msg} ({time.time() - t0:.0f} s)", flush=True)
            acc = imb = 0.0
    for h in hooks:
        h.remove()

# -----------------------------------------------------------------------------------------------
# 4. INT4: the routed experts ship pack-quantized (group 32, symmetric, q in [-7, 7]). int4_roundtrip gives
# exactly the weights the exported file serves; a short quantization-aware fine-tune trains through it with
# a straight-through estimator (forward: rounded weights, backward: identity).


def int4_roundtrip(w: torch.Tensor, dtype: torch.dtype, serve_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., O, I] float -> the served weights: cast to the export dtype, checkpoint.quantize_int4, dequantize like
    model.dequant_int4 (q * scale, rounded to the dtype the model is served in)."""
    with torch.no_grad():
        q, s = C.quantize_int4(w.detach().reshape(-1, w.shape[-1]).to(dtype), GROUP)
        deq = q.view(q.shape[0], -1, GROUP).float() * s.float().unsqueeze(-1)
        return deq.to(serve_dtype or dtype).float().view(w.shape)


def experts_dense(x, ids, weights, w13, w2) -> torch.Tensor:
    """model.Experts.forward without its per-expert loop: every expert on every token, mixed by an [N, E]
    matrix that is zero off each token's top-k. Same values and gradients for E x the FLOPs, but a few
    kernels instead of ~10 per expert: training this small model on a GPU is bound by kernel launches."""
    combine = torch.zeros(x.shape[0], w13.shape[0], dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
    gate, up = torch.einsum("nd,efd->nef", x, w13).chunk(2, dim=-1)                # [N, E, I] each
    y = torch.einsum("nei,edi->ned", F.silu(gate) * up, w2)                          # [N, E, D]
    return (y.float() * combine.unsqueeze(-1)).sum(1)                                # [N, D] fp32


@contextlib.contextmanager
def expert_forward(model: M.Transformer, dense: bool = False, int4: tuple | None = None):
    """Inside, the routed experts compute with experts_dense (dense=True) or model.Experts.forward as written, and, with
    int4 = (export dtype, serve dtype), on int4_roundtrip(w): the weights the exported file will serve, with
    straight-through gradients to w (quantization-aware training)."""
    wt = (lambda w: w + (int4_roundtrip(w, *int4).to(w.dtype) - w).detach()) if int4 else (lambda w: w)
    experts = [layer.mlp.experts for layer in model.layers if isinstance(layer.mlp, M.MoE)]
    for ex in experts:     # float experts: no fast path takes them, so forward is the loop as written
        if dense:
            ex.forward = lambda x, w, ids, ex=ex: experts_dense(x, ids, w, wt(ex.w13), wt(ex.w2))
        else:              # the loop, on the weights each expert will serve
            ex.expert = lambda e, ex=ex: (wt(ex.w13[e]), wt(ex.w2[e]))
    try:
        yield
    finally:
        for ex in experts:
            ex.__dict__.pop("forward" if dense else "expert")


def export_target(model: M.Transformer, text_cfg: dict, out_dir: str, dtype=torch.bfloat16, n_shards: int = 3) -> None:
    """K2.6 layout: nested kimi_k25 config, `language_model.` prefix, INT4 pack-quantized experts, shards + index.
    Everything in `dtype` except the router bias (fp32, as in K2.6)."""
    state = {k: v.to("cpu", torch.float32 if "e_score_correction_bias" in k else dtype)
             for k, v in C.hf_state_dict(model).items()}
    C.save_checkpoint(state, C.k26_config(text_cfg, GROUP), out_dir, n_shards=n_shards)


def load_target(ckpt: str, device, dtype) -> M.Transformer:
    """The exported target as it serves (bf16 + Triton INT4 kernels on CUDA), frozen."""
    import generate as G
    return C.load_model(ckpt, device, dtype, progress=False).requires_grad_(False)


def train_and_export_target(p: dict, num_base: int, train: torch.Tensor, val: torch.Tensor, tdir: str, device,
                            serve_dtype: torch.dtype, r: dict, log: dict) -> None:
    """Steps 3-4: train the float target, round its experts to INT4, then a short QAT at low LR; keep whichever
    serves better and export it to tdir. Fills r's val_float, val_ptq, val_qat, qat_kept, target_params,
    train_final and log's target / qat curves."""
    text_cfg = target_config(p, num_base)
    with torch.device(device):
        model = M.Transformer(C.model_args(text_cfg))
    init_weights_(model, p["layers"])
    ev = lambda: evaluate(model, val, p["ctx"], p["eval_windows"], device)
    dense = device.type == "cuda"
    with expert_forward(model, dense):
        train_target(model, train, val, p, device, log)
        r["val_float"] = ev()
    with expert_forward(model, dense, int4=(torch.bfloat16, serve_dtype)):
        r["val_ptq"] = ev()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        train_target(model, train, val, p, device, log, steps=p["qat_steps"], lr=p["lr"] * 0.1, tag="qat")
        r["val_qat"] = ev()
    r["qat_kept"] = r["val_qat"] < r["val_ptq"]
    if not r["qat_kept"]:
        model.load_state_dict(before)
    export_target(model, text_cfg, tdir, dtype=torch.bfloat16)
    r["target_params"] = sum(t.numel() for t in model.parameters())
    r["train_final"] = log["target"]["loss"][-1]

# -----------------------------------------------------------------------------------------------
# 3-4 reused (--target-from DIR): the target an earlier run exported, with what that run logged about it.

TARGET_FILES = ("config.json", "tiktoken.model", "tokenizer_config.json")
# The settings that shaped the target (and max_files, which picks the held-out split): the earlier run's win, so
# the held-out files are still ones the target never trained on, and the card describes the target that ships.
TARGET_KEYS = ("bpe_vocab", "dim", "layers", "heads", "q_lora", "kv_lora", "nope", "rope", "v", "dense_inter",
               "moe_inter", "experts", "topk", "ctx", "batch", "steps", "lr", "bias_u", "qat_steps", "max_files")
TARGET_RESULTS = ("val_float", "val_ptq", "val_qat", "qat_kept", "target_params", "train_final")


def check_target_dir(path: str) -> Path:
    """The --target-from dir, or a one-line ValueError naming it and what it lacks (before any work is done)."""
    d, want = Path(path), f"a {TARGET_DIR} dir exported by train.py ({', '.join(TARGET_FILES)}, safetensors shards)"
    if not d.is_dir():
        raise ValueError(f"--target-from {path}: no such directory; expected {want}")
    if missing := [f for f in TARGET_FILES if not (d / f).is_file()]:
        raise ValueError(f"--target-from {path}: no {', '.join(missing)}; expected {want}")
    return d


def earlier_log(src: Path) -> dict:
    """The train_log.json the earlier run wrote next to src (its <out>), or {} if it was killed before that."""
    path = src.resolve().parent / "train_log.json"
    return files.read_json(str(path)) if files.regular_file(path) else {}


def adopt_target_settings(p: dict, log: dict) -> None:
    """p's TARGET_KEYS := the earlier run's, saying which change (a later call need not repeat --steps etc.)."""
    old = log.get("config", {})
    changed = {k: old[k] for k in TARGET_KEYS if k in old and old[k] != p.get(k)}
    if changed:
        print(f"--target-from: the target's settings from its train_log.json: {changed}", flush=True)
    p.update(changed)


def copy_target(src: Path, tdir: str) -> tk.Tokenizer:
    """src's files into tdir (unless src is tdir); the tokenizer is read from the copy: the corpus is encoded by
    the files that ship, as when step 2 trains the BPE."""
    if src.resolve() != Path(tdir).resolve():
        shutil.copytree(src, tdir, dirs_exist_ok=True, copy_function=files.copy_file)
    return tk.Tokenizer.from_dir(tdir)


def check_target_matches(p: dict, preset: str, tdir: str, num_base: int) -> None:
    """Steps 5-6 take the context (YaRN original_max_position_embeddings) from p, the card the target's shape:
    p must describe the target in tdir (it does after adopt_target_settings; without a log, only the same preset)."""
    want = C.model_args(target_config(p, num_base))
    have = dataclasses.replace(C.model_args(tdir), quant=None, nested=False)
    if diff := [f.name for f in dataclasses.fields(want) if getattr(want, f.name) != getattr(have, f.name)]:
        raise ValueError(f"--target-from: {tdir}/config.json differs from the {preset} preset's target in {diff}: "
                         f"use the preset it was trained with")


def reuse_target_log(earlier: dict, target: M.Transformer, r: dict, log: dict) -> None:
    """What steps 3-4 would have put in r and log, from the earlier run's log. Without one, the parameter count
    is recomputed and the rest stays absent (n/a in the card)."""
    old = earlier.get("results", {})
    r.update({k: old[k] for k in TARGET_RESULTS if k in old})
    log.update({k: earlier[k] for k in ("target", "qat") if k in earlier})
    if "target_params" not in r:                   # the float model's count: the loaded one packs its experts
        with torch.device("meta"):
            r["target_params"] = sum(t.numel() for t in M.Transformer(dataclasses.replace(target.args, quant=None))
                                     .parameters())

# -----------------------------------------------------------------------------------------------
# 5. Drafter: DFlash trained on the frozen INT4 target (DFlash, arXiv 2602.06036). Each sequence gets random anchors;
# the block at anchor a is [token_a, MASK x (bs-1)] at positions a..a+bs-1, sees the context features of
# positions < a (the anchor's own feature is not known at inference) and its own block (bidirectional),
# never another block; block slot k predicts token a+k with weight exp(-(k-1)/gamma).


def drafter_config(p: dict, target_args: M.ModelArgs, num_base: int) -> dict:
    L, n = target_args.num_hidden_layers, p["draft_layers"]
    taps = sorted({min(max(i, 0), L - 1) for i in dflash.build_target_layer_ids(L, n)})   # shallow targets: clamp
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=target_args.hidden_size,
                intermediate_size=p["draft_inter"], num_hidden_layers=n, num_attention_heads=4,
                num_key_value_heads=2, head_dim=target_args.hidden_size // 4, hidden_act="silu", rms_norm_eps=1e-5,
                rope_theta=50000.0, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                      original_max_position_embeddings=p["ctx"], beta_fast=32.0,
                                                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                max_position_embeddings=4 * p["ctx"], attention_bias=False, vocab_size=target_args.vocab_size,
                tie_word_embeddings=False, block_size=8, num_target_layers=L, layer_types=["full_attention"] * n,
                dflash_config=dict(mask_token_id=num_base + 254, target_layer_ids=taps),
                torch_dtype="bfloat16")


def drafter_train_forward(drafter: dflash.DFlashDrafter, embed, feats: torch.Tensor, tokens: torch.Tensor,
                          anchors: torch.Tensor) -> torch.Tensor:
    """All blocks of a batch in one pass of the plain drafter (DFlashDrafter.plain_forward).
    feats [B, T, n_taps*D] (target taps for tokens [B, T]), anchors [B, A] -> normalized block
    hidden states [B, A, bs, D], each equal to DFlashDrafter.cached_forward at that anchor."""
    a = drafter.args
    B, T = tokens.shape
    A, bs = anchors.shape[1], a.block_size
    N = A * bs                                                                       # block rows per sequence
    block = torch.full((B, A, bs), a.mask_token_id, dtype=torch.long, device=tokens.device)
    block[:, :, 0] = tokens.gather(1, anchors)                                      # slot 0: the real token
    x = embed(block.view(B, N)) * a.input_embedding_scale                           # [B, N, D]
    blk_pos = (anchors[:, :, None] + torch.arange(bs, device=tokens.device)).view(B, N)
    # keys = [context (T) | all blocks (N)]: context strictly before the row's anchor, own block only
    row_anchor = anchors.repeat_interleave(bs, dim=1)                               # [B, N]
    see_ctx = torch.arange(T, device=tokens.device) < row_anchor[:, :, None]        # [B, N, T]
    blk = torch.arange(A, device=tokens.device).repeat_interleave(bs)               # [N]
    see_blk = (blk[:, None] == blk[None, :]).expand(B, N, N)                        # [B, N, N]
    mask = torch.cat([see_ctx, see_blk], dim=-1)                                    # [B, N, T+N]
    return drafter.plain_forward(x, feats, blk_pos, mask).view(B, A, bs, -1)


def sample_anchors(B: int, T: int, A: int, bs: int, gen: torch.Generator) -> torch.Tensor:
    """A distinct anchors per row in [1, T-bs]: >= 1 context feature, and all bs-1 labels inside the window."""
    return torch.stack([torch.randperm(T - bs, generator=gen)[:A] + 1 for _ in range(B)]).sort(dim=1).values


def drafter_loss(drafter, target: M.Transformer, tokens: torch.Tensor, anchors: torch.Tensor,
                 soft: torch.Tensor | None = None, gamma: float = 4.0):
    """Position-decayed cross-entropy over block slots 1..bs-1, against the tokens (hard labels) or, on the rows
    where soft [B] is True, against the target's own distribution at each label's position (soft labels: a tree
    drafted from them is what sampling verification accepts). Returns (loss, top-1 accuracy per slot [bs-1])."""
    bs = drafter.args.block_size
    with torch.no_grad(), torch.autocast(tokens.device.type, enabled=False):   # the target exactly as it serves
        t_logits, feats = target(tokens, hidden_layers=tuple(drafter.target_layer_ids))   # [B, T, V], [B, T, taps*D]
    h = drafter_train_forward(drafter, target.embed_tokens, feats, tokens, anchors)   # [B, A, bs, D]
    logits = target.head(h[:, :, 1:].to(target.lm_head.weight.dtype))              # [B, A, bs-1, V] fp32
    k = torch.arange(1, bs, device=tokens.device)
    pos = (anchors[:, :, None] + k).flatten(1)                                      # [B, A*(bs-1)] label positions
    labels = tokens.gather(1, pos).view_as(logits[..., 0])                          # [B, A, bs-1]
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    if soft is not None and soft.any():     # the target's distribution over label i is its output at position i-1
        p = t_logits.float().gather(1, (pos - 1)[..., None].expand(-1, -1, logits.shape[-1])).softmax(-1)
        soft_ce = -(p.view_as(logits) * logits.float().log_softmax(-1)).sum(-1)    # [B, A, bs-1]
        ce = torch.where(soft[:, None, None], soft_ce, ce)
    w = torch.exp(-(k - 1) / gamma)                                                  # [bs-1]
    loss = (ce * w).sum(-1).mean() / w.sum()
    return loss, (logits.argmax(-1) == labels).float().mean((0, 1))


def train_drafter(drafter, target, train, val, p, device, log, batch_fn=None, steps=None, lr=None,
                  tag="drafter") -> None:
    """The DFlash recipe on corpus windows; batch_fn(gen) -> (tokens, anchors, soft) swaps in other data
    (the self-distillation stage below)."""
    a, steps, lr = drafter.args, steps or p["draft_steps"], lr or p["draft_lr"]
    opt = make_optimizer(drafter, lr, wd=0.01)
    gen = torch.Generator().manual_seed(3)
    curve = log.setdefault(tag, {"step": [], "loss": [], "val_step": [], "val_loss": [], "val_acc": []})
    t0, acc = time.time(), 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=min(100, steps // 10))
        if batch_fn is None:
            tokens = get_batch(train, p["draft_batch"], p["ctx"] - 1, gen, device)      # [B, ctx]
            anchors = sample_anchors(tokens.shape[0], p["ctx"], p["anchors"], a.block_size, gen).to(device)
            soft = None
        else:
            tokens, anchors, soft = batch_fn(gen)
        with autocast(device):
            loss, _ = drafter_loss(drafter, target, tokens, anchors, soft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        acc += loss.item()
        if (step + 1) % p["log_every"] == 0 or step == steps - 1:
            k = (step % p["log_every"]) + 1
            curve["step"].append(step + 1)
            curve["loss"].append(acc / k)
            msg = f"{tag} step {step + 1}/{steps}: loss {acc / k:.3f}"
            if (step + 1) % (5 * p["log_every"]) == 0 or step == steps - 1:
                vl, va = evaluate_drafter(drafter, target, val, p, device)
                curve["val_step"].append(step + 1)
                curve["val_loss"].append(vl)
                curve["val_acc"].append(va)
                msg += f", held-out {vl:.3f}, top-1 per slot {' '.join(f'{x:.2f}' for x in va)}"
            print(f"{msg} ({time.time() - t0:.0f} s)", flush=True)
            acc = 0.0


@torch.no_grad()
def rollouts(target: M.Transformer, data: torch.Tensor, n: int, prefix: int, new: int, batch: int,
             gen: torch.Generator, device, temperature: float = 0.0) -> torch.Tensor:
    """n sequences [n, prefix + new]: a random corpus window of `prefix` tokens, then the target's own continuation
    (batched, with the KV cache), greedy at temperature 0, else sampled. On a greedy continuation a block's labels
    are exactly the tokens greedy verification accepts: corpus labels teach the drafter the data, these the target."""
    target.setup_cache(batch, prefix + new)
    noise = torch.Generator(device).manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    pick = lambda out: verify.sample(out.logits[:, -1], temperature, generator=noise)             # [batch]
    seqs = []
    for _ in range(max(1, n // batch)):
        x = get_batch(data, batch, prefix - 1, gen, device)                                # [batch, prefix]
        out = [pick(target(x, start_pos=0, last_only=True))]
        for t in range(new - 1):
            out.append(pick(target(out[-1][:, None], start_pos=prefix + t)))
        seqs.append(torch.cat([x, torch.stack(out, 1)], 1))
    return torch.cat(seqs)                                                                  # [n, prefix + new]


def distill_drafter(drafter, target, train, val, p, device, log) -> None:
    """Self-distillation: fine-tune the drafter on the target's own rollouts, anchors in the rollout part. Greedy
    rollouts with their tokens as labels teach greedy decoding; rollouts sampled at temperature 1 with the target's
    distributions as labels (soft) teach what sampling accepts."""
    prefix, new, bs = p["ctx"] // 2, p["ctx"] // 2, drafter.args.block_size
    t0, gen, n = time.time(), torch.Generator().manual_seed(11), p["distill_rollouts"]
    n_sampled = round(n * p.get("distill_sampled", 0.0))
    seqs = torch.cat([rollouts(target, train, k, prefix, new, p.get("rollout_batch", 64), gen, device, temp)
                      for k, temp in ((n - n_sampled, 0.0), (n_sampled, 1.0)) if k])       # [n, prefix + new]
    soft = torch.arange(len(seqs), device=device) >= len(seqs) - n_sampled                 # [n] sampled rows
    print(f"distill: {len(seqs) - int(soft.sum())} greedy and {int(soft.sum())} sampled rollouts of {new} tokens "
          f"({time.time() - t0:.0f} s)", flush=True)

    def batch_fn(gen):
        ix = torch.randint(len(seqs), (p["draft_batch"],), generator=gen).to(seqs.device)
        n_anchor = min(p["anchors"], new - bs)
        anchors = torch.stack([torch.randperm(new - bs, generator=gen)[:n_anchor] + prefix
                               for _ in range(len(ix))]).sort(1).values
        return seqs[ix], anchors.to(device), soft[ix]
    train_drafter(drafter, target, train, val, p, device, log, batch_fn=batch_fn, steps=p["distill_steps"],
                  lr=p["draft_lr"] / 2, tag="distill")


@torch.no_grad()
def evaluate_drafter(drafter, target, val, p, device, n_batches: int = 4) -> tuple[float, list[float]]:
    gen = torch.Generator().manual_seed(4)                                          # the same windows every time
    drafter.eval()
    losses, accs = [], []
    for _ in range(n_batches):
        tokens = get_batch(val, p["draft_batch"], p["ctx"] - 1, gen, device)
        anchors = sample_anchors(tokens.shape[0], p["ctx"], p["anchors"], drafter.args.block_size, gen).to(device)
        with autocast(device):
            loss, acc = drafter_loss(drafter, target, tokens, anchors)
        losses.append(loss.item())
        accs.append(acc)
    drafter.train()
    return sum(losses) / len(losses), [round(float(x), 4) for x in torch.stack(accs).mean(0)]

# -----------------------------------------------------------------------------------------------
# 6. Evaluation: held-out losses, sizes on disk, mean accept length of DDTree (budget 8) and the DFlash chain.


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


@torch.no_grad()
def accept_lengths(target_dir: str, draft_dir: str, val: torch.Tensor, tok: tk.Tokenizer, n_prompts: int,
                   device, dtype, prompt_len: int = 96, new_tokens: int = 96) -> dict[str, float]:
    """Greedy generate.generate on held-out code, tokens per verify step (bonus included): prompts that are
    file openings (licence headers, module docstrings: hard to draft) and prompts cut from the middle of the
    held-out files (seeded positions)."""
    import generate as G
    target = load_target(target_dir, device, dtype)
    drafter = C.load_drafter(draft_dir, target_args=target.args, device=device, dtype=dtype)
    openings = (val == tok.bos_id).nonzero().flatten().tolist()[:n_prompts]
    g = torch.Generator().manual_seed(5)
    middles = torch.randint(len(val) - prompt_len - 1, (2 * n_prompts,), generator=g).tolist()
    out = {}
    for where, starts in [("", openings), ("_midfile", middles)]:
        for name, kw in [("ddtree_b8", dict(budget=8)), ("chain", dict(chain=True, budget=8)),
                         ("ddtree_b8_t1", dict(budget=8, temperature=1.0))]:
            lens = []
            for s in starts:
                stats = G.Stats()
                G.generate(target, val[s:s + prompt_len].tolist(), new_tokens, drafter=drafter, stats=stats, **kw)
                lens += stats.accept_lens
            out[name + where] = sum(lens) / len(lens)
    return out


def fmt(r: dict, key: str, spec: str = ".4f") -> str:
    """r[key] formatted, or 'n/a': a --target-from run whose earlier run left no log lacks the target's figures."""
    return "n/a" if r.get(key) is None else format(r[key], spec)


def qat_outcome(r: dict) -> str:
    return {True: "kept", False: "discarded: no gain"}.get(r.get("qat_kept"), "n/a")


def stage_clock(r: dict) -> Callable[[str], None]:
    """lap(name): the wall-clock seconds since the previous lap go to r['stage_seconds'][name] and are printed
    (on a GPU whose calls are time-limited, this says which steps fit in one call)."""
    seconds, last = r.setdefault("stage_seconds", {}), [time.time()]

    def lap(name: str) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()                   # count queued kernels in the stage that launched them
        now = time.time()
        seconds[name], last[0] = round(now - last[0], 3), now
        print(f"stage {name}: {seconds[name]:.1f} s", flush=True)
    return lap


def write_log(out: str, log: dict, r: dict) -> None:
    log["results"] = r
    files.write_json(os.path.join(out, "train_log.json"), log, indent=1)


def write_model_card(out: str, r: dict, p: dict) -> None:
    mb = lambda n: f"{n / 1e6:.2f} MB"
    src = r.get("target_from")
    cmd = f"python train.py --out {out} --preset {r['preset']}" + (f" --target-from {src}" if src else "")
    if src and r.get("train_final") is None:
        trained = f"Trained by an earlier run that left no `train_log.json` next to `{src}`: training figures n/a."
    else:
        trained = (f"{p['steps']} steps x {p['batch']} x {p['ctx']} tokens, then {p['qat_steps']} quantization-aware "
                   f"steps ({qat_outcome(r)})" + (f"; trained by an earlier run, copied from `{src}`." if src else "."))
    sampled = p.get("distill_sampled", 0.0)
    steps_s = ", ".join(f"{k} {v:.0f}" for k, v in r.get("stage_seconds", {}).items())
    card = f"""# tiny-k2 + tiny-k2-dflash

`{cmd}`: {r['seconds']:.0f} s on {r['device']} (torch {torch.__version__},
Python {r['python']}). Loss curves: `train_log.json`. Seconds per stage: {steps_s}.

**Data.** The Python {r['python']} standard library (`*.py` <= 200 KB, no test suites, `idlelib`, `lib2to3`,
`encodings`): {r['train_files']} training files ({r['train_tokens']:,} tokens); {r['val_files']} held-out files
({r['val_tokens']:,} tokens, `heldout_files.txt`, picked by a hash of the path).

**Tokenizer.** Byte-level BPE, {r['num_base']} tokens (256 bytes + merges, K2 pre-tokenizer regex), trained with
`tokenizers`, shipped as a Kimi `tiktoken.model`; K2 special tokens at {r['num_base']}..{r['num_base'] + 255}.

**Target** (`{TARGET_DIR}/`, K2.6 layout): DeepSeek-V3/K2 architecture, hidden {p['dim']}, {p['layers']} layers
(1 dense + {p['layers'] - 1} MoE), {p['heads']} MLA heads, {p['experts']} routed experts top-{p['topk']} + 1 shared,
YaRN x4 over a {p['ctx']}-token training context; {fmt(r, 'target_params', ',')} parameters,
{mb(r['target_bytes'])} on disk (bf16, routed experts INT4 group {GROUP}). {trained}

| held-out next-token loss (nats) | |
|---|---|
| float | {fmt(r, 'val_float')} |
| INT4 experts, rounded after training | {fmt(r, 'val_ptq')} |
| INT4 experts after quantization-aware steps | {fmt(r, 'val_qat')} |
| exported checkpoint loaded back ({r['serve_dtype']}) | {fmt(r, 'val_exported')} |
| (training loss, last {p['log_every']} steps) | {fmt(r, 'train_final')} |

**Drafter** (`{DRAFT_DIR}/`, public DFlash layout): {p['draft_layers']} Qwen3-style layers, block size 8, target
layers {r['taps']}, mask token {r['mask_id']} ([UNK]); {r['draft_params']:,} parameters, {mb(r['draft_bytes'])}.
{p['draft_steps']} steps x {p['draft_batch']} sequences x {p['anchors']} random anchors against the exported INT4
target, then {p.get('distill_steps', 0)} self-distillation steps on {p.get('distill_rollouts', 0)} rollouts of the
target: {1 - sampled:.0%} greedy (labels = the tokens greedy verification accepts), {sampled:.0%} sampled at
temperature 1 (labels = the target's distribution at each position). Held-out loss (corpus labels)
{r['draft_val']:.4f}; top-1 accuracy per block slot 1..7: {r['draft_acc']}.

**Speculative decoding** (96-token held-out prompts, 96 new tokens, tokens per target forward):

| prompts | DDTree budget 8, greedy | DFlash chain, greedy | DDTree budget 8, temperature 1 |
|---|---|---|---|
| {p['eval_prompts']} held-out file openings | {r['accept']['ddtree_b8']:.2f} | {r['accept']['chain']:.2f} | {r['accept']['ddtree_b8_t1']:.2f} |
| {2 * p['eval_prompts']} windows from the middle of held-out files | {r['accept']['ddtree_b8_midfile']:.2f} | {r['accept']['chain_midfile']:.2f} | {r['accept']['ddtree_b8_t1_midfile']:.2f} |

Total on disk: {mb(r['total_bytes'])} (budget {mb(SIZE_BUDGET)}).
"""
    files.write_text(os.path.join(out, "model_card.md"), card)


def check_args(a: argparse.Namespace) -> Path | None:
    """Every flag, before the corpus is read: a ValueError naming the flag. Returns the --target-from dir."""
    check_ranges([("--steps", a.steps is None or a.steps >= 1, ">= 1", a.steps),
                  ("--draft-steps", a.draft_steps is None or a.draft_steps >= 1, ">= 1", a.draft_steps),
                  ("--max-files", a.max_files is None or a.max_files >= 0, ">= 0 (0: all)", a.max_files),
                  ("--seed", 0 <= a.seed < 2**63, "in [0, 2^63)", a.seed)])
    if a.device:
        check_device(a.device)
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise ValueError(f"--out {a.out}: not a directory: expected the output directory (made if missing)")
    src = check_target_dir(a.target_from) if a.target_from else None
    try:
        os.makedirs(a.out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {a.out}: cannot make the directory ({e.strerror.lower()})") from None
    if src is not None:                     # what this run writes must not be a file of the target it reads
        tdir = os.path.join(a.out, TARGET_DIR)
        copied = [] if os.path.exists(tdir) and os.path.samefile(src, tdir) else \
            [os.path.join(tdir, n) for n in os.listdir(src)]
        written = copied + [os.path.join(a.out, DRAFT_DIR, n) for n in ("config.json", "model.safetensors")] + \
            [os.path.join(a.out, n) for n in ("heldout_files.txt", "model_card.md")]
        for path in written:
            files.check_not_input("--out", path, [src])
    return src


def main(a: argparse.Namespace) -> dict:
    src = check_args(a)                                                    # fail before any work
    p = dict(PRESETS[a.preset])
    p.update({k: v for k, v in dict(steps=a.steps, draft_steps=a.draft_steps, max_files=a.max_files).items()
              if v is not None})
    p.setdefault("qat_steps", max(1, p["steps"] // 10))
    earlier = earlier_log(src) if src else {}
    adopt_target_settings(p, earlier)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    serve_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(a.seed)
    t_start = time.time()
    out, tdir, ddir = a.out, os.path.join(a.out, TARGET_DIR), os.path.join(a.out, DRAFT_DIR)
    os.makedirs(tdir, exist_ok=True)
    log: dict = {"preset": a.preset, "config": p}
    r: dict = dict(preset=a.preset, python=sys.version.split()[0], serve_dtype=str(serve_dtype)[6:],
                   device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU")
    if src:
        r["target_from"] = str(src)
    lap = stage_clock(r)

    # 1. corpus
    train_texts, val_texts, held = load_corpus(p["max_files"])
    files.write_text(os.path.join(out, "heldout_files.txt"), "\n".join(held) + "\n")
    r.update(train_files=len(train_texts), val_files=len(held))
    lap("corpus")

    # 2. tokenizer: train, export, then encode with the exported files (the serving tokenizer); or the copied ones
    if src:
        tok = copy_target(src, tdir)
        check_target_matches(p, a.preset, tdir, tok.num_base_tokens)
    else:
        ranks = bpe_ranks(train_bpe(train_texts, p["bpe_vocab"]))
        if len(ranks) % 8:
            raise ValueError(f"BPE vocab {len(ranks)} is not a multiple of 8 (TP 1/2/4/8): use a larger corpus/vocab")
        tok = write_tokenizer(tdir, ranks)
    num_base = tok.num_base_tokens
    train, val = encode_corpus(tok, train_texts), encode_corpus(tok, val_texts)
    r.update(num_base=num_base, train_tokens=len(train), val_tokens=len(val))
    print(f"corpus: {len(train_texts)} files, {len(train):,} tokens; held out: {len(held)} files, {len(val):,} "
          f"tokens; BPE vocab {num_base} + 256 special ({time.time() - t_start:.0f} s)", flush=True)
    lap("tokenizer")

    # 3-4. target: train, INT4, export (or the earlier run's), then load it back as it serves
    if not src:
        train_and_export_target(p, num_base, train, val, tdir, device, serve_dtype, r, log)
    target = load_target(tdir, device, serve_dtype)
    if src:
        reuse_target_log(earlier, target, r, log)
    r["val_exported"] = evaluate(target, val, p["ctx"], p["eval_windows"], device)
    print(f"held-out loss: float {fmt(r, 'val_float')}, INT4 {fmt(r, 'val_ptq')}, after QAT {fmt(r, 'val_qat')} "
          f"({qat_outcome(r)}), exported {fmt(r, 'val_exported')}", flush=True)
    lap("target")
    write_log(out, log, r)                         # a run killed in the drafter steps still leaves the target's log

    # 5. drafter against the frozen exported target
    torch.manual_seed(a.seed + 1)                  # its init does not depend on whether this run trained the target
    dcfg = drafter_config(p, target.args, num_base)
    dargs = C.draft_args(dcfg)
    C.check_drafter_compatible(dargs, target.args)
    with torch.device(device):
        drafter = dflash.DFlashDrafter(dargs)
    init_weights_(drafter, dargs.num_hidden_layers)
    save_drafter = lambda: C.write_drafter(ddir, {k: v.to("cpu", torch.bfloat16) for k, v in drafter.state_dict().items()},
                                           dcfg)
    train_drafter(drafter, target, train, val, p, device, log)
    save_drafter()                                 # a run stopped during distillation still leaves a drafter
    lap("drafter")
    if p.get("distill_steps"):
        distill_drafter(drafter, target, train, val, p, device, log)
    lap("distill")

    # 6. evaluation: the drafter's held-out loss, accept lengths with the shipped files, sizes, the log, the card
    r["draft_val"], r["draft_acc"] = evaluate_drafter(drafter, target, val, p, device)
    save_drafter()
    r.update(taps=dargs.target_layer_ids, mask_id=dargs.mask_token_id,
             draft_params=sum(t.numel() for t in drafter.parameters()))
    r["accept"] = accept_lengths(tdir, ddir, val, tok, p["eval_prompts"], device, serve_dtype)
    r.update(target_bytes=dir_bytes(tdir), draft_bytes=dir_bytes(ddir))
    r["total_bytes"] = r["target_bytes"] + r["draft_bytes"]
    lap("eval")
    r["seconds"] = time.time() - t_start
    write_log(out, log, r)
    write_model_card(out, r, p)
    print(f"mean accept length: DDTree budget 8 {r['accept']['ddtree_b8']:.2f} (temperature 1: "
          f"{r['accept']['ddtree_b8_t1']:.2f}), chain {r['accept']['chain']:.2f}; "
          f"{r['total_bytes'] / 1e6:.2f} MB on disk; done in {r['seconds']:.0f} s, see {out}/model_card.md")
    if r["total_bytes"] > SIZE_BUDGET:
        print(f"WARNING: {r['total_bytes'] / 1e6:.2f} MB is over the {SIZE_BUDGET / 1e6:.0f} MB budget")
    return r


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output dir: <out>/tiny-k2, <out>/tiny-k2-dflash, logs, card")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's target steps")
    ap.add_argument("--draft-steps", type=int, default=None, help="override the preset's drafter steps")
    ap.add_argument("--max-files", type=int, default=None, help="use an even sample of this many stdlib files")
    ap.add_argument("--target-from", metavar="DIR", default=None,
                    help="skip steps 3-4: use the tiny-k2 dir an earlier run exported (DIR/../train_log.json, "
                         "if there, gives its settings and figures)")
    ap.add_argument("--seed", type=int, default=1337)
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(parse_args())))
