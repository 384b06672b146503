"""The shipped checkpoints/ pair loads through the same code path as a real Kimi K2.6 checkpoint (nested
kimi_k25 config, compressed-tensors INT4 experts kept packed, `language_model.` prefix, shards + index, Kimi
tiktoken tokenizer) and decodes losslessly. Run: python -m pytest -q tests/test_bundled.py"""
import json
import os

import pytest
import torch

import checkpoint as C
import draft as dflash
import generate as G
import model as M
from tokenizer import Tokenizer

FLOOR_PROMPT = "code-ring-buffer"      # of bench_prompts.json


def test_bundled_pair_takes_the_k26_path():
    ckpt, draft = G.BUNDLED_TARGET, G.BUNDLED_DRAFT
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    assert cfg["model_type"] == "kimi_k25" and "text_config" in cfg
    index = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in index)
    assert any(n.endswith("experts.0.up_proj.weight_packed") for n in index)
    args = C.model_args(ckpt)
    assert args.nested and args.quant is not None and args.quant.group_size == 32
    target = C.load_model(ckpt, torch.device("cpu"), torch.float32, progress=False)
    moe = next(l.mlp for l in target.layers if isinstance(l.mlp, M.MoE))
    assert moe.experts.w13_packed.dtype == torch.int32 and not hasattr(moe.experts, "w13")   # never dequantized
    tok = Tokenizer.from_dir(ckpt)
    assert tok.vocab_size == args.vocab_size and tok.num_base_tokens + 256 == tok.vocab_size
    drafter = C.load_drafter(draft, target.args, torch.device("cpu"), torch.float32)
    prompt = tok.encode("def read_config(path):\n    \"\"\"Read a JSON config file.\"\"\"\n    with open(path) as f:\n")
    ar = G.generate(target, prompt, 40, max_seq_len=160)
    st = G.Stats()
    assert G.generate(target, prompt, 40, drafter=drafter, budget=8, max_seq_len=160, stats=st) == ar
    assert st.mean_accept > 1.2


@pytest.mark.quick
def test_bundled_pair_acceptance_floor():
    """Speed is an invariant too: a break that stays lossless (the drafter's context rows out of order, a chain
    one node short, a context row lost) shows only as fewer tokens per step. The bundled pair on a fixed code
    prompt, CPU fp32, budget 8: the tree's and the chain's mean accept length stay above floors a little under
    what they measure (5.4 and 5.7; the context rows reversed give 2.9 and 2.3)."""
    target = C.load_model(G.BUNDLED_TARGET, torch.device("cpu"), torch.float32, progress=False)
    drafter = C.load_drafter(G.BUNDLED_DRAFT, target.args, torch.device("cpu"), torch.float32)
    tok = Tokenizer.from_dir(G.BUNDLED_TARGET)
    prompts = json.load(open(os.path.join(G.HERE, "bench_prompts.json")))
    prompt = tok.encode(next(p["text"] for p in prompts["prompts"] if p["id"] == FLOOR_PROMPT))
    for chain, floor in ((False, 5.0), (True, 5.0)):
        st = G.Stats()
        G.generate(target, prompt, 48, drafter=drafter, budget=8, chain=chain, max_seq_len=256, stats=st)
        assert st.mean_accept > floor, (chain, st.mean_accept)
