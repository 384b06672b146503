"""
bench.py: how fast nano-ddtree decodes, and how far one step is from the memory-bandwidth floor.

Decoding one request of a K2-class model is memory-bound: a step has to read at least the weights it uses and
the KV cache it attends over, and nothing else matters much at batch 1. So next to tokens/s we measure a
*byte floor* per step: the bytes a step must read divided by the copy bandwidth of this GPU, measured in the
same run (a large device-to-device copy, bytes read + written / time). For one K2.6 MoE layer those bytes are
the bf16 attention weights, the INT4 experts that the step's tokens actually route to (the union over the
tokens: a tree of N nodes touches far more experts than one token), the shared expert,
the router and the compressed KV cache (576 values per cached token). floor / latency is the memory-bandwidth
utilisation (MBU) of the step. At batch 1 engines run far below it: fixed
per-layer costs (kernel launches, all-reduces, small-M MoE kernels) dominate, which is what `layers` shows.

Modes:
  e2e     autoregressive vs DFlash chain vs DDTree over node budgets, on the prompts in bench_prompts.json,
          greedy and temperature 1: tokens/s, speedup over autoregressive, mean accept length and histogram,
          time per stage (draft / tree / verify / commit), peak memory, and whether greedy speculative output
          equals autoregressive output token for token ("lossless").
          --one-rank-of N: rank 0 of TP N, whole, on one device in one process: the step times of AR, DDTree
          at each budget and auto with the collectives NOT run (each a no-op that counts its calls), the
          collectives per step, and tok/s projected at given accept lengths and a stated cost per collective.
  step    one decode step of the e2e pair (AR and DDTree), replayed from the same inputs in each step mode
          (static, graph, compile, graph+compile): its time against the summed time of the kernels it launches,
          and what a CUDA graph of N trivial kernels costs on this GPU (the per-node floor).
  layers  one K2.6-shaped MoE block (and the dense layer-0 block) built directly with random weights at the
          real dimensions (INT4 experts as random packed words), a KV cache of several lengths, and the step
          latency for T = 1, 9, 17, 33 new tokens (tree-masked verify for T > 1: eager, CUDA graph back to back,
          and the graph with a cold L2 as in a step) against its byte floor; then a
          projection to the whole 61-layer model at TP8, with every assumption printed. --fusions: the MoE block
          again with each fusion of kernels.FUSE off, one at a time: what each saves (time, kernels).
  peer    the same layer through transformers' DeepseekV3DecoderLayer (experts dequantized to bf16) at the
          same T and context, and the AR decode of the e2e model through DeepseekV3ForCausalLM: their time /
          ours.
  tree    the DDTree build of one step at Kimi's vocabulary: the op-by-op builder vs the one-launch search (on a
          GPU), and the vocabulary ranking both share, per budget; the two trees compared field by field.
  kernels the INT4 MoE and MLA attention kernels against their references at K2.6 shapes (GPU): error, eager /
          CUDA-graph / cold-L2 time, share of the copy bandwidth; --sweep: their launch configs; --resources
          (any machine): the MoE kernels compiled for sm_90, their registers, spills and tensor-core instructions.
  all     the three in turn (e2e, layers, peer).

    python bench.py e2e                                   # bundled tiny model + drafter (CPU ok)
    python bench.py e2e --budgets 4,16 --temperature 0 --max-new-tokens 64 --out runs/e2e.json
    python bench.py e2e --budgets auto,8 --prompts checkpoints/heldout_files.txt   # --budget auto beside budget 8
    python bench.py e2e --batch 1,16,64 --budgets 8,auto     # batched: AR, DDTree-8 and auto at each batch size
    python bench.py e2e --budgets 1,8 --bound             # and the accept a perfect drafter would reach
    python bench.py e2e --ckpt random:k2.6 --one-rank-of 8 --budgets 8,16 --step-mode graph --temperature 0
                                                          # one H200: rank 0 of TP8, collectives not run
    python bench.py step                                  # the bundled pair's step: eager vs graph vs compile
    python bench.py layers --scale tiny                   # CPU: every dimension shrunk (a smoke test)
    python bench.py layers --tp 8 --out runs/layers.json  # one H200, per-rank TP8 shapes, real dimensions
    python bench.py layers --tp 8 --ctx 4096 --T 1,9 --fusions   # and each fusion of kernels.FUSE off in turn
    python bench.py peer --tp 1 --ctx 4096                # one H200 (the peer's bf16 experts: 34 GB)
    python bench.py tree --budgets 8,16,64                # V = 163840, L = 7 by default (CPU ok)
    python bench.py kernels [--sweep]                     # one GPU: kernels vs references, timings
    python bench.py kernels --resources                   # any machine: the MoE kernels compiled for sm_90
    torchrun --nproc-per-node 8 bench.py e2e --ckpt <Kimi-K2.6> --draft <Kimi-K2.6-DFlash> --chat
    torchrun --nproc-per-node 8 bench.py e2e --ckpt random:k2.6 --budgets 8,16 --step-mode graph
                                                          # K2.6's shapes, random weights: step times, no download

Caveats, printed where they apply:
  * in eager step mode the stage timer synchronizes the GPU after every stage (generate.py): stage costs are
    measured as the eager loop pays them, not as a CUDA graph would;
  * in bf16 a greedy near-tie can flip when the verify width changes the kernel path, so on the GPU a
    "lossless: False" is a numerics question before it is a bug;
  * random inputs route like uniform routing; real tree siblings route alike, so real unions are smaller.

The last stdout line is one JSON document with everything printed above it; --out FILE.json writes it to a
file, plus FILE.png (accept length and tokens/s against the budget) when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import heapq
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import checkpoint as C
import cli
import draft as dflash
import files
import kernels
import model as M
import runner
import tree as ddtree
import verify
from checkpoint import k26_draft_config, k26_text_config
from tree import ancestor_mask

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS_FILE = os.path.join(HERE, "bench_prompts.json")
print0 = M.print0


# ----------------------------------------------------------------------------------------------
# Environment header, timing, bandwidth


def _version(name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(argv: list[str], device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": argv, "host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": _version("triton"),
            "transformers": _version("transformers"), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0, "driver": _driver() if cuda else None,
            "cpu_threads": torch.get_num_threads(), "world_size": M.world_size}


def print_header(env: dict) -> None:
    print0(f"# nano-ddtree bench, {env['date']} on {env['host']}")
    print0(f"# command: {' '.join(env['argv'])}")
    gpu = f"{env['gpu']} x{env['gpu_count']}, driver {env['driver']}, CUDA {env['cuda']}" if env["gpu"] else \
        f"no GPU ({env['cpu_threads']} CPU threads)"
    print0(f"# device: {env['device']}: {gpu}; world size {env['world_size']}")
    print0(f"# python {env['python']}, torch {env['torch']}, triton {env['triton']}, "
           f"transformers {env['transformers']}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, graph: bool = False, iters: int = 10, warmup: int = 2) -> float:
    """Median seconds per call of fn after warm-up. CUDA: triton's do_bench (CUDA events, L2 flushed between
    calls, so weights come from HBM as in a real step), or do_bench_cudagraph (graph=True: launch overhead
    removed). CPU: time.perf_counter."""
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph
        ms = do_bench_cudagraph(fn, return_mode="median") if graph else do_bench(fn, return_mode="median")
        return ms * 1e-3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_size(a, device: torch.device) -> int:
    """Bytes of the bandwidth copy: --copy-mb, else 2 GiB on a GPU (several times its L2), 128 MiB on a CPU."""
    return a.copy_mb * 2**20 if a.copy_mb else (2 * 2**30 if device.type == "cuda" else 128 * 2**20)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Copy bandwidth of this device in bytes/s: (bytes read + bytes written) / time of one big copy."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / t


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def step_name(budget) -> str:
    """A row's step as the tables print it: AR (no budget), DDTree <budget> or auto (--budget auto)."""
    return "auto" if budget == "auto" else f"DDTree {budget}" if budget else "AR"


# ----------------------------------------------------------------------------------------------
# e2e: autoregressive vs DFlash chain vs DDTree on the fixed prompt set


def heldout_prompts(list_file: str, n: int = 0, chars: int = 320, seed: int = 0) -> list[dict]:
    """Code prompts the bundled model never trained on: windows of `chars` characters from the standard-library
    files that train.py held out (listed in `list_file`, read from this interpreter's stdlib), each starting at
    a line chosen (seeded) in the middle 80% of its file; one window per file, cycling over the files for n > #files.
    ~320 characters is ~100 tokens of the bundled BPE, so prompt + 128 new tokens stays inside its 256-token context."""
    import random
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    with open(list_file) as f:
        rels = [line.strip() for line in f if line.strip()]
    texts = {}
    for rel in rels:
        path = os.path.join(root, rel)
        if os.path.exists(path):        # another Python version may lack a file: skip it, the others stay held out
            with open(path, encoding="utf-8", errors="replace") as f:
                texts[rel] = f.read()
    if not texts:
        raise FileNotFoundError(f"{list_file}: none of its {len(rels)} held-out files exist under {root}")
    rng, out, names = random.Random(seed), [], list(texts)
    for i in range(n or len(names)):
        rel = names[i % len(names)]
        text = texts[rel]
        starts = [j + 1 for j, c in enumerate(text) if c == "\n" and 0.1 * len(text) <= j < 0.9 * len(text) - chars]
        start = rng.choice(starts) if starts else 0
        out.append({"id": f"{rel}@{start}", "category": "heldout-code", "text": text[start:start + chars]})
    return out


def load_prompts(path: str, n: int = 0) -> list[dict]:
    """The prompt set, categories interleaved (code, math, prose, code, ...) so that the first n cover them all.
    `path` ending in .txt: a list of held-out stdlib files (train.py's heldout_files.txt), see heldout_prompts."""
    if path.endswith(".txt"):
        return heldout_prompts(path, n)
    prompts = read_prompt_set(path)
    by_cat: dict[str, list] = {}
    for p in prompts:
        by_cat.setdefault(p["category"], []).append(p)
    rounds = max(map(len, by_cat.values()))
    ordered = [ps[i] for i in range(rounds) for ps in by_cat.values() if i < len(ps)]
    return ordered[:n] if n > 0 else ordered


def read_prompt_set(path: str) -> list[dict]:
    """A prompt set file's prompts: {"prompts": [{"category": str, "text": str, ...}, ...]}, at least one; any
    other shape is a ValueError naming the file and the field."""
    f = C.Fields(files.read_json(path), path)
    prompts = f.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise f.bad("prompts", prompts, "a non-empty list of {category, text} objects")
    for i, p in enumerate(prompts):
        entry = C.Fields(p, path, f"prompts[{i}]")
        for key in ("category", "text"):
            if not isinstance(entry.get(key), str):
                raise entry.bad(key, entry.get(key), "a string")
    return prompts


def encode_prompts(prompts: list[dict], tok_dir: str, vocab: int, chat: bool) -> tuple[list[list[int]], str]:
    """Token ids per prompt with the checkpoint's tokenizer; without one (random test models), the UTF-8
    bytes mod the vocabulary size, so the ids are still fixed and in range."""
    if os.path.exists(os.path.join(tok_dir, "tiktoken.model")):
        from tokenizer import Tokenizer
        tok = Tokenizer.from_dir(tok_dir)
        if chat:
            return [tok.apply_chat_template([{"role": "user", "content": p["text"]}]) for p in prompts], \
                f"{tok_dir} (chat template)"
        return [tok.encode(p["text"]) for p in prompts], f"{tok_dir} (raw text)"
    return [[b % vocab for b in p["text"].encode()] for p in prompts], \
        "no tiktoken.model in the checkpoint: UTF-8 bytes mod vocab"


def e2e_modes(budgets: list, drafter, chain: bool) -> list[tuple[str, int | str]]:
    modes = [("ar", 0)]
    if drafter is not None:
        modes += [("chain", 0)] if chain else []
        modes += [("auto", b) if b == "auto" else ("ddtree", b) for b in budgets]
    return modes


def summarize(stats: list, device: torch.device) -> dict:
    """Sum the per-prompt Stats of one mode. tokens: decoded tokens (the first comes from prefill, so
    new_tokens - 1 per prompt, as Stats.tokens_per_s counts); time_s: decode time."""
    tokens = sum(s.new_tokens - 1 for s in stats)
    time_s = sum(s.decode_s for s in stats)
    accept = [a for s in stats for a in s.accept_lens]
    hist: dict[str, int] = {}
    for a in sorted(accept):
        hist[str(a)] = hist.get(str(a), 0) + 1
    stage_s = {k: sum(s.stage_s[k] for s in stats) for k in stats[0].stage_s}
    steps = len(accept)
    return {"tokens": tokens, "time_s": time_s, "tokens_per_s": tokens / time_s if time_s > 0 else 0.0,
            "prefill_s": sum(s.prefill_s for s in stats), "steps": steps, "accept_sum": sum(accept),
            "mean_accept": sum(accept) / steps if steps else 0.0, "accept_hist": hist, "stage_s": stage_s,
            "stage_ms_per_step": {k: 1e3 * v / steps if steps else 0.0 for k, v in stage_s.items()},
            "peak_rss_bytes": C.peak_rss_bytes(),
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_mode(target, drafter, prompt_ids, mode: str, budget: int, temperature: float, a, device,
             max_seq_len: int, reference: list | None) -> dict:
    """Decode every prompt in one mode; reference = the greedy AR outputs (for the lossless column)."""
    import generate as G
    kw = dict(drafter=drafter if mode != "ar" else None, budget=budget, chain=mode == "chain",
              temperature=temperature, max_seq_len=max_seq_len, mode=a.step_mode)
    if a.warmup != 0:      # compile / load this mode's kernels for every shape it will meet, outside the timing
        longest = max(prompt_ids, key=len)
        G.generate(target, longest, a.max_new_tokens if a.warmup < 0 else a.warmup, seed=0, **kw)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats, outs = [], []
    for i, ids in enumerate(prompt_ids):
        st = G.Stats()
        outs.append(G.generate(target, ids, a.max_new_tokens, seed=i, stats=st, **kw))
        stats.append(st)
    r = {"mode": mode, "budget": budget if mode == "ddtree" else None, "temperature": temperature}
    if mode == "auto":     # the share of steps auto ran at each budget (0: one token)
        mix = G.Stats()
        for s in stats:
            mix.budgets.update(s.budgets)
        r["budget_mix"] = mix.budget_mix()
    elif mode != "ar":
        n_nodes = budget + 1 if mode == "ddtree" else drafter.block_size
        r["verify_tokens"] = n_nodes
        r["mla_path"] = "absorbed, Triton" if n_nodes <= 64 else "absorbed, reference attention (> 64 rows)"
    r.update(summarize(stats, device))
    r["per_prompt"] = [{"tokens": s.new_tokens - 1, "time_s": s.decode_s, "tokens_per_s": s.tokens_per_s,
                        "mean_accept": s.mean_accept, "steps": len(s.accept_lens)} for s in stats]
    if reference is not None and mode != "ar":
        diffs = [_first_diff(o, ref) for o, ref in zip(outs, reference)]
        for p, d in zip(r["per_prompt"], diffs):
            p["lossless"], p["first_diff"] = d is None, d
        r["lossless"] = all(d is None for d in diffs)
    else:
        r["lossless"] = None     # the AR reference itself, or sampling (outputs differ by design)
    r["outputs"] = outs
    return r


def warm_up(target, drafter, prompt_ids, a, max_seq_len: int) -> None:
    """One untimed pass over every prompt, AR and (with a drafter) DFlash chain: eager kernels meet each
    shape of the run for the first time here (first calls of a new shape cost up to ~10 ms per step on the
    GPU, which would otherwise land in whichever mode runs first)."""
    import generate as G
    for ids in prompt_ids:
        G.generate(target, ids, a.max_new_tokens, max_seq_len=max_seq_len)
        if drafter is not None:
            G.generate(target, ids, a.max_new_tokens, drafter=drafter, chain=True, max_seq_len=max_seq_len)


def _e2e_paths(a) -> tuple[str, str | None]:
    import generate as G
    ckpt = a.ckpt or G.BUNDLED_TARGET
    paired = G.BUNDLED_DRAFT if ckpt == G.BUNDLED_TARGET else ckpt + "-dflash" if C.is_random(ckpt) else None
    draft = a.draft if a.draft is not None else paired
    draft = draft or None                   # --draft '': autoregressive only
    if not os.path.isdir(ckpt) and not C.is_random(ckpt):
        raise FileNotFoundError(f"target checkpoint {ckpt} not found: build the bundled one with "
                                f"`python train.py --out checkpoints`, or pass --ckpt (and --draft)")
    if draft is not None and not os.path.isdir(draft) and not C.is_random(draft):
        raise FileNotFoundError(f"drafter checkpoint {draft} not found (pass --draft, or --draft '' for AR only)")
    return ckpt, draft


@torch.no_grad()
def bench_e2e(a, device, dtype) -> dict:
    import generate as G
    ckpt, draft_dir = _e2e_paths(a)
    target = C.load_model(ckpt, device, dtype, progress=False)
    drafter = C.load_drafter(draft_dir, target.args, device, dtype) if draft_dir else None
    prompts = load_prompts(a.prompts, a.n_prompts)
    prompt_ids, tok_note = encode_prompts(prompts, a.tokenizer or ckpt, target.args.vocab_size, a.chat)
    widest = max([G.AUTO_BUDGET if b == "auto" else b for b in a.budgets] + [drafter.block_size if drafter else 1])
    max_seq_len = a.max_seq_len or max(map(len, prompt_ids)) + a.max_new_tokens + widest + 8
    print0(f"\n## e2e: {ckpt}" + (f" + drafter {draft_dir}" if draft_dir else " (no drafter: AR only)")
           + f" on {device}, {str(dtype).replace('torch.', '')}")
    print0(f"{len(prompts)} prompts ({', '.join(sorted({p['category'] for p in prompts}))}), tokens: {tok_note}; "
           f"{a.max_new_tokens} new tokens each; cache {max_seq_len}; warm-up: "
           + ("none" if a.warmup == 0 else f"every prompt once (AR + chain), then "
              f"{a.max_new_tokens if a.warmup < 0 else a.warmup} tokens per mode"))
    modes = e2e_modes(a.budgets, drafter, not a.no_chain)
    if a.warmup != 0:
        warm_up(target, drafter, prompt_ids, a, max_seq_len)
    runs = []
    for temp in a.temperature:
        reference = None
        for mode, budget in modes:
            r = run_mode(target, drafter, prompt_ids, mode, budget, temp, a, device, max_seq_len, reference)
            if mode == "ar" and temp == 0:
                reference = r["outputs"]
            base = next(x for x in runs + [r] if x["mode"] == "ar" and x["temperature"] == temp)
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] > 0 else 0.0
            runs.append(r)
    for r in runs:
        del r["outputs"]
    print_e2e(runs)
    if a.bound and drafter is not None:
        accept_bounds(target, drafter.block_size - 1, prompt_ids, runs, a.max_new_tokens, max_seq_len)
    return {"target": ckpt, "draft": draft_dir, "dtype": str(dtype).replace("torch.", ""),
            "tokenizer": tok_note, "max_new_tokens": a.max_new_tokens, "max_seq_len": max_seq_len,
            "block_size": drafter.block_size if drafter else None,
            "prompts": [{"id": p.get("id"), "category": p["category"], "prompt_tokens": len(ids)}
                        for p, ids in zip(prompts, prompt_ids)], "runs": runs}


@torch.no_grad()
def oracle_tree(target, ctx: list[int], budget: int, depth: int, temperature: float) -> tuple[list, list, list, list]:
    """The DDTree of a perfect drafter: the `budget` most probable paths of at most `depth` tokens below the root
    ctx[-1], a path's probability being the product of the target's own sampling probabilities (verify.sampling_probs)
    along it. Best-first as tree.build_tree_heap: pop the best candidate, push its next sibling (the parent's next
    most probable token) and its first child; probabilities never grow along a path, so the first `budget` pops
    are the optimal prefix-closed set. Zero-probability tokens are never pushed (temperature 0: the greedy chain).
    Returns per node, root first: parent, token, path probability, the target's logits [V] after ctx + its path
    (one full forward without the KV cache per node: start_pos None leaves the cache alone)."""
    dev = target.embed_tokens.weight.device
    parent, token, prob, path, logits, ranked = [-1], [ctx[-1]], [1.0], [[]], [], []

    def expand(i: int) -> None:   # node i's logits, its next tokens by probability (ties: lower id first)
        x = target(torch.tensor([ctx + path[i]], device=dev), last_only=True).logits[0, -1]        # [V] fp32
        logits.append(x)
        ranked.append(verify.sampling_probs(x, temperature).sort(descending=True, stable=True))          # [V] each
    expand(0)
    heap = [(-ranked[0][0][0].item(), 0, 0, 0)]   # (-path probability, tie-break, parent node, rank of the token)
    while heap and len(token) <= budget:
        neg, _, par, r = heapq.heappop(heap)
        (p, order), i = ranked[par], len(token)
        parent.append(par); token.append(int(order[r])); prob.append(-neg); path.append(path[par] + [token[-1]])
        if r + 1 < len(p) and p[r + 1] > 0:
            heapq.heappush(heap, (-prob[par] * p[r + 1].item(), i, par, r + 1))
        expand(i)   # also for a depth-`depth` node: the walk draws the bonus from it
        if len(path[i]) < depth and ranked[i][0][0] > 0:
            heapq.heappush(heap, (-prob[i] * ranked[i][0][0].item(), i, i, 0))
    return parent, token, prob, logits


@torch.no_grad()
def oracle_decode(target, prompt: list[int], max_new_tokens: int, budget: int, depth: int, temperature: float,
                  seed: int, max_seq_len: int) -> list[tuple[int, float]]:
    """Decode `prompt` as DDTree does, with the target as its own drafter: each step builds oracle_tree at the
    context c, then walks it as verification does: x = verify.sample(the target's logits after c + path) (argmax
    at temperature 0, all draws from one generator seeded `seed`); if x is a child of the current node, move there
    and repeat, else stop and commit the path's tokens plus x (the bonus). Returns per step (tokens committed, its
    expectation = 1 + the sum of the nodes' path probabilities). The first token comes from the prompt's forward,
    as generate's prefill does; every step counts all it commits, as Stats.accept_lens does (the last one may run
    past max_new_tokens), and no step is cut: the run stops before a step could pass max_seq_len."""
    g = torch.Generator(target.embed_tokens.weight.device).manual_seed(seed)
    first = verify.sample(target(torch.tensor([prompt], device=g.device), last_only=True).logits[0, -1], temperature,
                     generator=g)
    ctx, n, steps = prompt + [int(first)], 1, []
    while n < max_new_tokens and len(ctx) + depth + 1 <= max_seq_len:
        parent, token, prob, logits = oracle_tree(target, ctx, budget, depth, temperature)
        node, got = 0, []
        while True:   # verification's walk: the target's token after the node; on to the child that carries it
            got.append(int(verify.sample(logits[node], temperature, generator=g)))
            node = next((i for i in range(1, len(token)) if parent[i] == node and token[i] == got[-1]), None)
            if node is None:
                break
        steps.append((len(got), 1 + sum(prob[1:])))
        ctx, n = ctx + got, n + len(got)
    return steps


def accept_bounds(target, depth: int, prompt_ids, runs: list[dict], max_new_tokens: int, max_seq_len: int) -> None:
    """--bound: each DDTree run's r["accept_bound"], the mean accept (tokens per step, bonus included, as e2e's
    mean_accept) over every step of every prompt that a perfect drafter reaches: the target drafting for itself
    (oracle_decode, seeded per prompt) at the run's temperature and budget, depth <= L = block_size - 1 as the
    real tree; r["accept_bound_expected"]: the mean of its per-step expectations. Prints the table."""
    rows = []
    for r in runs:
        if r["mode"] == "ddtree":
            steps = [s for i, ids in enumerate(prompt_ids) for s in oracle_decode(
                target, ids, max_new_tokens, r["budget"], depth, r["temperature"], i, max_seq_len)]
            mean = lambda xs: sum(xs) / len(xs) if xs else None   # no step: max_new_tokens 1, or a full cache
            r["accept_bound"], r["accept_bound_expected"] = mean([k for k, _ in steps]), mean([e for _, e in steps])
            ratio = r["mean_accept"] / r["accept_bound"] if r["accept_bound"] else None
            rows.append([_f(r["temperature"], "g"), r["budget"], _f(r["mean_accept"], ".2f"),
                         _f(r["accept_bound"], ".2f"), _f(r["accept_bound_expected"], ".2f"), _f(ratio, ".2f"),
                         len(steps)])
    print0(table(["temp", "budget", "drafter accept", "bound", "E[bound]", "drafter/bound", "bound steps"], rows))
    print0("bound: the accept of a perfect drafter (the target drafting its own best-first tree, depth <= "
           f"{depth}); E[bound]: its expectation per step, 1 + the nodes' path probabilities, averaged")


@torch.no_grad()
def bench_batch(a, device, dtype) -> dict:
    """--batch N,...: N requests decoded together (prompts cycled from the set), AR, then DDTree at each --budgets
    (auto: generate.py's --budget auto, with the share of steps it ran at each budget); tokens/s per request and
    in total. Greedy: each mode's outputs must equal AR's at the same batch ("lossless")."""
    import generate as G
    ckpt, draft_dir = _e2e_paths(a)
    target = C.load_model(ckpt, device, dtype, progress=False)
    drafter = C.load_drafter(draft_dir, target.args, device, dtype) if draft_dir else None
    prompts = load_prompts(a.prompts, a.n_prompts)
    prompt_ids, _ = encode_prompts(prompts, a.tokenizer or ckpt, target.args.vocab_size, a.chat)
    modes = [("ar", 0)] + ([("auto" if b == "auto" else "ddtree", b) for b in a.budgets] if drafter else [])
    widest = max(G.AUTO_BUDGET if b == "auto" else b for _, b in modes)
    max_seq_len = a.max_seq_len or max(map(len, prompt_ids)) + a.max_new_tokens + widest + 16
    rows = []
    for n in a.batch:
        batch, ar = [prompt_ids[i % len(prompt_ids)] for i in range(n)], None
        for mode, budget in modes:
            kw = dict(drafter=drafter if budget else None, budget=budget, max_seq_len=max_seq_len,
                      mode=a.step_mode if a.step_mode != "eager" else "static")
            G.generate_batch(target, batch, a.max_new_tokens, **kw)                   # warm-up (and capture)
            st = G.Stats()
            outs = G.generate_batch(target, batch, a.max_new_tokens, stats=st, **kw)
            ar = outs if mode == "ar" else ar
            tokens = sum(len(o) for o in outs)
            rows.append({"batch": n, "mode": mode, "budget": budget or None, "tokens": tokens,
                         "time_s": st.decode_s, "total_tokens_per_s": tokens / st.decode_s,
                         "per_request_tokens_per_s": tokens / st.decode_s / n, "mean_accept": st.mean_accept,
                         "lossless": outs == ar,
                         "budget_mix": st.budget_mix() if mode == "auto" else None})
    print0(table(["batch", "mode", "budget", "tokens", "time s", "tok/s total", "tok/s per request", "accept",
                  "= AR", "steps per budget"],
                 [[r["batch"], r["mode"], r["budget"] or "", r["tokens"], _f(r["time_s"], ".2f"),
                   _f(r["total_tokens_per_s"]), _f(r["per_request_tokens_per_s"]), _f(r["mean_accept"], ".2f"),
                   "yes" if r["lossless"] else "NO", r["budget_mix"] or ""] for r in rows]))
    print0("batched decoding runs the fixed-shape step (finished rows masked); time includes the first token of "
           "each request after prefill; = AR: greedy outputs equal AR's at the same batch; steps per budget: "
           "--budget auto's choices (0: one token)")
    return {"target": ckpt, "draft": draft_dir, "budgets": a.budgets, "rows": rows}


def print_e2e(runs: list[dict]) -> None:
    rows = []
    for r in runs:
        st = r["stage_ms_per_step"]
        lossless = {None: "ref" if r["mode"] == "ar" and r["temperature"] == 0 else "-", True: "yes", False: "NO"}
        hist = " ".join(f"{k}:{v}" for k, v in r["accept_hist"].items())
        cuda = r["cuda_max_allocated_bytes"]
        rows.append([_f(r["temperature"], "g"), r["mode"], _f(r["budget"], "d"), r["tokens"], _f(r["time_s"], ".2f"),
                     _f(r["tokens_per_s"]), _f(r["speedup"], ".2f"), _f(r["mean_accept"], ".2f"), r["steps"],
                     *[_f(st[k], ".2f") for k in ("draft", "tree", "verify", "commit")],
                     _f(r["peak_rss_bytes"] / 2**30, ".2f"),
                     _f(None if cuda is None else cuda / 2**30, ".2f"),
                     lossless[r["lossless"]], hist[:40]])
    print0(table(["temp", "mode", "budget", "tokens", "time s", "tok/s", "speedup", "accept", "steps", "draft ms",
                  "tree ms", "verify ms", "commit ms", "RSS GiB", "CUDA GiB", "lossless", "accept histogram"], rows))
    print0("stage times are per verify step (eager loop, GPU synchronized after every stage); RSS is the process "
           "peak so far; lossless: greedy output == greedy autoregressive output on every prompt")
    for r in runs:
        if r["mode"] == "auto":    # its choices, and how it compares with the fastest fixed mode of this run
            fixed = [x for x in runs if x["temperature"] == r["temperature"] and x["mode"] in ("ar", "ddtree")]
            best = max(fixed, key=lambda x: x["tokens_per_s"])
            print0(f"auto at temperature {r['temperature']:g}: steps per budget {r['budget_mix']} (0: one token); "
                   f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}x the fastest fixed mode "
                   f"({best['mode']}{' ' + str(best['budget']) if best['budget'] else ''})")
    bad = [r for r in runs if r["lossless"] is False]
    if bad:
        print0("lossless NO: in bf16 a near-tie can flip when the verify width changes kernel paths "
               "; first differing token per prompt: "
               + "; ".join(f"{r['mode']} {r['budget']}: {[p['first_diff'] for p in r['per_prompt']]}" for r in bad))


# ----------------------------------------------------------------------------------------------
# e2e --one-rank-of N: rank 0 of tensor parallel size N, whole, in one process. The target, the drafter and the
# decoding step are built and run at model.world_size = N, model.rank = 0 (rank 0's exact shapes), so they call
# every collective where TP N calls it; collectives_not_run makes each of those calls a no-op that counts itself.
# The step times are measured; the collectives' cost is not: the projection adds it at --allreduce-us per call.


def _gather_own(outputs: list, tensor: torch.Tensor, *args, **kw) -> None:
    for out in outputs:
        out.copy_(tensor)


NOOP_COLLECTIVES = {   # name -> what its no-op leaves in the outputs: this rank's own data, so every value is defined
    "all_reduce": lambda tensor, *args, **kw: None,              # this rank's partial sum stays as it is
    "all_gather": _gather_own,                                   # every slot gets this rank's tensor (a local copy)
    "all_gather_into_tensor": lambda out, tensor, *args, **kw: out.view(-1, *tensor.shape).copy_(tensor),
    "all_gather_object": lambda objs, obj, *args, **kw: objs.__setitem__(slice(None), [obj] * len(objs)),
    "broadcast": lambda *args, **kw: None,                       # rank 0 is the source: its data stands
    "broadcast_object_list": lambda *args, **kw: None,
    "barrier": lambda *args, **kw: None,
}


@contextlib.contextmanager
def collectives_not_run(tp: int):
    """Inside: model.world_size = tp and model.rank = 0 with no process group (modules built here get rank 0's
    shapes; their forward calls each collective that TP tp calls), and each torch.distributed function in
    NOOP_COLLECTIVES is a no-op that counts its calls in the Counter this yields (name -> calls, and "name bytes" ->
    the bytes of the tensors they were given). Nothing crosses
    a link and nothing waits for another rank. A collective not listed fails, as without a process group. Used by
    e2e --one-rank-of only; model.py and draft.py are untouched (they look up torch.distributed at each call)."""
    import torch.distributed as dist
    counts: collections.Counter = collections.Counter()

    def counted(name: str, noop):
        def call(*args, **kw):
            if not torch.compiler.is_compiling():   # counted eagerly (step_collectives); a compiled step would
                counts[name] += 1                   # otherwise guard on the counter and recompile at every call
                t = next((x for x in args if isinstance(x, torch.Tensor)), None)   # the message (all_gather: input)
                counts[name + " bytes"] += 0 if t is None else t.numel() * t.element_size()
            noop(*args, **kw)
        return call

    saved, old_tp = {name: getattr(dist, name) for name in NOOP_COLLECTIVES}, (M.world_size, M.rank)
    for name, noop in NOOP_COLLECTIVES.items():
        setattr(dist, name, counted(name, noop))
    M.set_tp(tp, 0)
    try:
        yield counts
    finally:
        M.set_tp(*old_tp)
        for name, fn in saved.items():
            setattr(dist, name, fn)


def step_collectives(target, drafter, budget: int, sampling: tuple, counts: collections.Counter,
                     batch: int = 1) -> dict:
    """The collectives of one decoding step of `batch` rows (budget 0: AR; B: DDTree B), counted: 2-token prefills,
    then one step run eagerly (the Python that a CUDA graph captures, so a replay makes the same calls).
    name -> calls, "name bytes" -> their bytes."""
    import generate as G
    drafter = drafter if budget else None
    step = G.Step(target, drafter, batch, budget, False, sampling)
    step.prefill([[0, 1]] * batch)
    counts.clear()
    step.run(step.tree_step if budget else step.token_step)
    return dict(counts)


def synthetic_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n token ids drawn uniformly from the vocabulary (seeded): a prompt that only sets the context length."""
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def bench_one_rank(a, device, dtype) -> dict:
    """e2e --one-rank-of N: rank 0 of TP N in this one process (collectives_not_run): for each --ctx (a synthetic
    prompt of that many tokens), --temperature and step (AR, then each --budgets: DDTree or auto): a warm-up decode
    from its first 16 tokens (kernels compiled, CUDA graphs captured), then a timed decode of --max-new-tokens by
    generate(mode=--step-mode). ms per step = decode time / steps: all the loop does after the first token. --batch:
    each batch size B decodes B such prompts together (generate_batch), and the step's top kernels are profiled. The
    collectives per step are counted with their bytes (step_collectives; auto: its steps' mix of the AR and the
    tree step's). Projection: total tok/s = B x accept / (ms per step + the collectives' time, project_one_rank)."""
    import generate as G
    if M.world_size > 1:
        raise ValueError("--one-rank-of runs in one process: run it without torchrun")
    tp = a.one_rank_of
    ckpt, draft_dir = _e2e_paths(a)
    steps = [0] + (list(a.budgets) if draft_dir else [])
    counted = sorted({G.AUTO_BUDGET if b == "auto" else b for b in steps})     # the steps whose collectives count
    widest, batches = max(counted) + 1, a.batch or [1]
    with collectives_not_run(tp) as counts:
        target = C.load_model(ckpt, device, dtype, progress=False)
        drafter = C.load_drafter(draft_dir, target.args, device, dtype) if draft_dir else None
        weights = param_bytes(target) + (param_bytes(drafter) if drafter else 0)
        print0(f"\n## e2e --one-rank-of {tp}: rank 0 of TP{tp} in one process: {ckpt}"
               + (f" + drafter {draft_dir}" if draft_dir else " (no drafter: AR only)")
               + f" on {device}, {str(dtype).replace('torch.', '')}, step mode {a.step_mode}")
        print0(f"THE COLLECTIVES DID NOT RUN: every torch.distributed collective that the model, the drafter and "
               f"the step call was a no-op that only counted its calls; their cost is projected below, not measured")
        print0(f"weights of this rank: {weights / 2**30:.2f} GiB; synthetic prompts of {', '.join(map(str, a.ctx))} "
               f"tokens (random ids, seed {a.seed}); {a.max_new_tokens} new tokens per run; warm-up: "
               + ("none" if a.warmup == 0 else f"{a.max_new_tokens if a.warmup < 0 else a.warmup} tokens per run "
                  "after the prompt's first 16"))
        target.setup_cache(max(batches), 2 + 2 * widest + 8)
        if drafter is not None:
            drafter.setup_cache(max(batches), 2 + 2 * widest + 8)
        per_step = {(t, b, n): step_collectives(target, drafter, b, (t, 0, 1.0), counts, n)
                    for t in a.temperature for b in counted for n in batches}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rows = []
        for ctx, B in ((ctx, B) for ctx in a.ctx for B in batches):
            prompts = [synthetic_prompt(ctx, target.args.vocab_size, a.seed + i) for i in range(B)]
            max_seq_len = ctx + a.max_new_tokens + widest + 8
            kept = runner.Steps()                 # this ctx's caches at their own size, as a real run has them
            target.setup_cache(B, max_seq_len + (widest if B > 1 else 0))
            if drafter is not None:
                drafter.setup_cache(B, max_seq_len)
            for temp in a.temperature:
                for b in steps:
                    kw = dict(drafter=drafter if b else None, budget=b, temperature=temp, max_seq_len=max_seq_len,
                              mode=a.step_mode, steps=kept)
                    if a.warmup != 0:     # short prompts: the step's shapes (and graphs) do not depend on them
                        G.generate_batch(target, [p[:16] for p in prompts],
                                         a.max_new_tokens if a.warmup < 0 else a.warmup, **kw)
                    st = G.Stats()
                    G.generate_batch(target, prompts, a.max_new_tokens, stats=st, **kw)
                    n = len(st.step_s)       # the collectives of the steps it ran (auto: a mix; catch_up not counted)
                    c = mix_collectives({k: per_step[temp, k, B] for k in st.budgets}, st.budgets)
                    step = G.get_step(target, kw["drafter"], B, max_seq_len, b, False, (temp, 0, 1.0), "eager",
                                      steps=kept) if b != "auto" else None  # kernel_times profiles eager launches
                    top = (kernel_times(lambda: step.launch(step.tree_step if b else step.token_step), device, top=6)
                           if a.batch and step else {})   # every row has finished: a step now commits nothing
                    rows.append({"ctx": ctx, "batch": B, "temperature": temp,
                                 "mode": "auto" if b == "auto" else "ddtree" if b else "ar",
                                 "budget_mix": st.budget_mix() if b == "auto" else None,
                                 "budget_steps": dict(st.budgets),
                                 "budget": b or None, "steps": n, "decode_s": st.decode_s,
                                 "ms_per_step": 1e3 * st.decode_s / n, "mean_accept": st.mean_accept,
                                 "prefill_s": st.prefill_s, "all_reduce": c.get("all_reduce", 0),
                                 "all_gather": c.get("all_gather", 0),
                                 "collectives": sum(v for k, v in c.items() if not k.endswith("bytes")),
                                 "collective_bytes": sum(v for k, v in c.items() if k.endswith("bytes")),
                                 "collective_calls": c, "top_kernels": top.get("top_kernels")})
                    print0(f"  ctx {ctx} batch {B} temp {temp:g} {step_name(b)}: "   # kept if a
                           f"{rows[-1]['ms_per_step']:.2f} ms/step", flush=True)                # later one fails
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    proj = project_one_rank(rows, a.accept, a.allreduce_us, a.allreduce_gbps, tp)
    print_one_rank(tp, rows, proj, a.accept, a.allreduce_us, a.allreduce_gbps, weights, peak,
                   a.step_mode == "eager" and device.type == "cuda")
    return {"one_rank_of": tp, "rank": 0, "collectives_run": False, "statement": COLLECTIVES_NOT_RUN,
            "target": ckpt, "draft": draft_dir, "dtype": str(dtype).replace("torch.", ""),
            "step_mode": a.step_mode, "max_new_tokens": a.max_new_tokens, "ctx": a.ctx, "batch": batches,
            "accept": a.accept, "allreduce_us": a.allreduce_us, "allreduce_gbps": a.allreduce_gbps,
            "weights_bytes": weights, "cuda_max_allocated_bytes": peak,
            "rows": rows, "projection": proj}


def mix_collectives(per_budget: dict, steps: collections.Counter) -> collections.Counter:
    """The collectives per step of the steps a decode ran (steps: budget -> steps; 0: one token): each budget's counts
    (per_budget[budget], a Counter) weighted by its share of the steps (a fixed budget: its own counts; auto: a mix)."""
    n, out = sum(steps.values()), collections.Counter()
    for b, k in steps.items():
        for name, v in per_budget[b].items():
            out[name] += v * k / n
    return out


COLLECTIVES_NOT_RUN = ("the collectives did not run: each was a no-op that counted its calls and bytes; the step "
                       "times exclude them and the tok/s add them at a stated latency per call plus the ring's bytes "
                       "at a stated bus bandwidth (--allreduce-us, --allreduce-gbps)")


def project_one_rank(rows: list[dict], accepts: list[float], costs_us: list[float], bus_gbps: float,
                     tp: int) -> list[dict]:
    """Per measured row and per latency: step ms = measured ms + the collectives' time, each call `cost` us plus its
    bytes x 2(tp-1)/tp (what a ring moves per rank) over the bus bandwidth; total tok/s = batch x tokens per step /
    step ms, where tokens per step is 1 for AR and each of `accepts` for DDTree (acceptance measured on random
    weights means nothing, so it is given, not taken from the run), and for auto the mean it measured (its choices
    follow it). Every collective (the lm_head's all-gather too) is charged as one all-reduce."""
    def comm_ms(r, cost):
        return r["collectives"] * cost / 1e3 + r["collective_bytes"] * 2 * (tp - 1) / tp / (bus_gbps * 1e9) * 1e3

    out = []
    for r in rows:
        ar = next((q for q in rows if q["mode"] == "ar" and all(q[k] == r[k] for k in ("ctx", "batch", "temperature"))),
                  None)
        for cost in costs_us:
            comm = comm_ms(r, cost)
            ms = r["ms_per_step"] + comm
            # the accept at which this step's tok/s equals AR's: what --budget auto weighs a tree against
            even = ms / (ar["ms_per_step"] + comm_ms(ar, cost)) if ar and r["mode"] == "ddtree" else None
            for acc in {"ar": [1.0], "auto": [r["mean_accept"]]}.get(r["mode"], accepts):
                out.append({"ctx": r["ctx"], "batch": r["batch"], "temperature": r["temperature"],
                            "mode": r["mode"], "budget": r["budget"], "accept": acc, "allreduce_us": cost,
                            "ms_per_step": r["ms_per_step"], "comm_ms": comm, "step_ms": ms,
                            "tokens_per_s_no_comm": 1e3 * acc * r["batch"] / r["ms_per_step"],
                            "tokens_per_s": 1e3 * acc * r["batch"] / ms, "break_even_accept": even})
    return out


def print_one_rank(tp: int, rows: list[dict], proj: list[dict], accepts: list[float], costs_us: list[float],
                   bus_gbps: float, weights: int, peak: int | None, eager_cuda: bool) -> None:
    print0(table(["ctx", "batch", "temp", "step", "steps", "ms/step", "all-reduces/step", "all-gathers/step",
                  "collectives/step", "MB/step", "accept here", "prefill s"],
                 [[r["ctx"], r["batch"], _f(r["temperature"], "g"), step_name(r["budget"]), r["steps"],
                   _f(r["ms_per_step"], ".2f"), *(_f(r[k], ".4g") for k in ("all_reduce", "all_gather", "collectives")),
                   _f(r["collective_bytes"] / 1e6, ".2f"),
                   _f(r["mean_accept"], ".2f"), _f(r["prefill_s"], ".2f")] for r in rows]))
    print0(f"ms/step: measured on rank 0 of TP{tp} with the collectives not run (decode time / steps"
           + ("; eager: the clock synchronizes the GPU after every stage" if eager_cuda else "") + "); "
           f"collectives/step and their MB: counted, one step of each kind run eagerly; accept here: on synthetic "
           f"prompts (and random weights for random:<name>), not a quality figure"
           + (f"; peak CUDA memory {peak / 2**30:.2f} GiB ({weights / 2**30:.2f} GiB weights)" if peak else ""))
    for r in rows:
        if r.get("top_kernels"):
            print0(f"  top kernels, ctx {r['ctx']} batch {r['batch']} {step_name(r['budget'])} (us per step): "
                   + "; ".join(f"{name} {us}" for name, us in r["top_kernels"]))
        if r["mode"] == "auto":
            print0(f"  auto, ctx {r['ctx']} batch {r['batch']}: steps per budget {r['budget_mix']} (0: one token)")
    print0(f"\nprojected TP{tp} decode, NOT MEASURED: total tok/s = batch x accept / (ms/step + comm), comm = every "
           f"collective at {', '.join(f'{c:g}' for c in costs_us)} us (--allreduce-us) + its bytes x 2({tp}-1)/{tp} "
           f"at {bus_gbps:g} GB/s (--allreduce-gbps, a ring's bus bandwidth): given figures, not measured here "
           f"(`torchrun ... bench.py allreduce` measures them); AR commits 1 token per row and step, DDTree the "
           f"given accept ({', '.join(f'{x:g}' for x in accepts)}; --accept), auto the accept it measured")
    print0(table(["ctx", "batch", "temp", "step", "accept", "cost us", "ms/step", "+ comm ms", "= ms/step",
                  "tok/s no comm", "tok/s", "pays above accept"],
                 [[p["ctx"], p["batch"], _f(p["temperature"], "g"), step_name(p["budget"]), _f(p["accept"], ".3g"),
                   _f(p["allreduce_us"], "g"), _f(p["ms_per_step"], ".2f"), _f(p["comm_ms"], ".2f"),
                   _f(p["step_ms"], ".2f"), _f(p["tokens_per_s_no_comm"]), _f(p["tokens_per_s"]),
                   _f(p["break_even_accept"], ".2f")] for p in proj]))
    print0("pays above accept: the tokens a tree step must commit for its tok/s to pass AR's at this batch (its "
           "ms/step over AR's); --budget auto runs one-token steps where the accept it measures stays below it")
    print0(COLLECTIVES_NOT_RUN)


# ----------------------------------------------------------------------------------------------
# layers: one K2.6-shaped block with random weights, latency vs byte floor, projection to the model


@contextlib.contextmanager
def per_rank_build(tp: int, device, dtype):
    """Modules created inside get rank 0's shapes at tensor parallel size tp, in `dtype` on `device`, with no
    process group: set_tp(tp, 0) while they are built, then back, so their forward runs at world size 1 and
    skips every all-reduce (model.py and draft.py gate them on model.world_size at call time)."""
    old_tp, old_dtype = (M.world_size, M.rank), torch.get_default_dtype()
    M.set_tp(tp, 0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        M.set_tp(*old_tp)
        torch.set_default_dtype(old_dtype)


def build_block(cfg: dict, layer_id: int, tp: int, device, dtype, seed: int) -> tuple[M.ModelArgs, M.Block]:
    """One model.Block of `cfg` with rank 0's per-rank shapes at tensor parallel size tp (see per_rank_build),
    holding the random weights of layer `layer_id` of checkpoint.random_model."""
    args = C.model_args(C.k26_config(cfg, 32))
    M.check_tp_divisibility(args, tp)
    with per_rank_build(tp, device, dtype):
        block = M.Block(layer_id, args)
        C.randomize_(block, seed, prefix=f"layers.{layer_id}.")
    block.requires_grad_(False)
    return args, block.eval()


def randn(shape: tuple, device, dtype, seed: int) -> torch.Tensor:
    """Seeded N(0, 1) drawn on the device itself (fast for the GPU-sized tensors here)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=dtype)


def tree_parents(T: int, kind: str, g: torch.Generator) -> list[int]:
    """Parents of a T-node verify tree: a chain, or a random recursive tree (each node under an earlier one)."""
    if kind == "chain":
        return [-1] + list(range(T - 1))
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]


def step_inputs(args: M.ModelArgs, T: int, ctx: int, tree: str, device, dtype, seed: int) -> dict:
    """Hidden states, rope and tree mask of T new tokens after ctx cached ones (positions ctx + depth)."""
    g = torch.Generator().manual_seed(seed * 1000 + T)
    mask = ancestor_mask(tree_parents(T, tree, g))
    positions = (ctx + mask.sum(-1) - 1).view(1, T).to(device)                            # [1, T]
    inv_freq, attn_factor = M.rope_inv_freq(args)
    cos, sin = M.rope_cos_sin(inv_freq, attn_factor, positions, dtype)
    x = torch.randn(1, T, args.hidden_size, generator=g).to(device, dtype)               # [1, T, D]
    r = torch.randn(1, T, args.hidden_size, generator=g).to(device) * 0.1                # the last MoE output, fp32
    # what Transformer.forward computes once for all 61 layers, so not part of one layer's step: the start as a
    # tensor (a captured decode step's) and the new tokens' cache slots
    start = torch.tensor([ctx], device=device)                                           # [1]
    return dict(x=x, r=r, cos=cos, sin=sin, mask=mask[None].to(device), positions=positions, start=start,
                slots=M._slots(start, 1, T, device))


def layer_step(block: M.Block, s: dict, cache: torch.Tensor, r: bool = True):
    """One layer's decode / verify step as the layer stack runs it (kernels.deferred_block; absorbed MLA, per-forward
    inputs given): the previous layer's MLP output s["r"] added first (r=False: none, the input is s["x"] alone).
    Returns (x, MLP out), whose sum is the layer's output."""
    return lambda: kernels.deferred_block(block, s["x"], s["r"] if r else None, s["cos"], s["sin"], cache, s["start"],
                                          s["mask"], True, s["slots"])


def sum_output(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A layer's output from layer_step's (x, MLP out)."""
    return x + r.to(x.dtype)


def routed_ids(block: M.Block, step) -> torch.Tensor | None:
    """The expert ids the step's tokens route to ([T, k]): the router on the MoE's input, caught with a hook (the
    MoE part's launcher routes without calling the Gate module)."""
    if not isinstance(block.mlp, M.MoE):
        return None
    box = []
    hook = block.mlp.register_forward_pre_hook(lambda mod, inp: box.append(inp[0]))
    try:
        step()
    finally:
        hook.remove()
    return block.mlp.gate(box[0].flatten(0, -2))[1]


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def step_bytes(block: M.Block, ids: torch.Tensor | None, ctx: int, T: int, kv_row_bytes: int) -> dict:
    """Bytes one step of this block must read (its per-rank weights; the KV cache is read whole by every rank)."""
    b = {"attention": param_bytes(block.self_attn) + param_bytes(block.input_layernorm)
         + param_bytes(block.post_attention_layernorm),
         "kv_cache": (ctx + T) * kv_row_bytes}
    if ids is None:
        b["dense_mlp"] = param_bytes(block.mlp)
    else:
        ex = block.mlp.experts
        parts = (ex.w13_packed, ex.w13_scale, ex.w2_packed, ex.w2_scale)       # one expert: [0] of each stack
        per_expert = sum(t[0].numel() * t.element_size() for t in parts)
        b.update(router=param_bytes(block.mlp.gate), shared_expert=param_bytes(block.mlp.shared_experts),
                 routed_experts=int(ids.unique().numel()) * per_expert)
    b["total"] = sum(b.values())
    return b


def use_triton(device) -> bool:
    """Whether the Triton kernels may run on this device at all; each kernel's fits() adds its own conditions."""
    return kernels.HAS_TRITON and kernels.ENABLED and torch.device(device).type == "cuda" and torch.cuda.is_available()


def uniform_union(n_experts: int, k: int, T: int) -> float:
    """Expected distinct experts when T tokens each pick k of n uniformly."""
    return n_experts * (1 - (1 - k / n_experts) ** T)


def time_step(step, device, graph: bool) -> tuple[float, float | None, str | None]:
    """(eager s, CUDA-graph s or None, why the graph failed or None)."""
    eager = median_time(step, device)
    if device.type != "cuda" or not graph:
        return eager, None, None
    try:
        return eager, median_time(step, device, graph=True), None
    except Exception as e:                  # a host sync in the step makes capture fail: report, don't stop
        return eager, None, f"{type(e).__name__}: {str(e)[:120]}"


def time_compiled(step, device) -> tuple[float | None, str | None]:
    """(seconds per call of a torch.compile'd step, or None and why compiling failed). The first call
    compiles, so it is made before timing."""
    try:
        step()
        sync(device)
        return median_time(step, device), None
    except Exception as e:                  # report and go on: compile support varies across torch versions
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def kernel_times(step, device, reps: int = 3, top: int = 12) -> dict:
    """What the GPU itself spends on one step: torch.profiler over `reps` eager steps, the durations of the
    device kernels (and memcpy/memset) summed per step. graph_us / kernels_us is the launch overhead a CUDA
    graph leaves (issue 10's target: <= 1.2); the top entries say where the step's time goes. Kernels launched here
    go without PDL: a PDL kernel starts early and waits for the one before it, and the wait would count as its time
    (a captured graph keeps the PDL it was captured with)."""
    if device.type != "cuda":
        return {"kernels_us": None, "n_kernels": None, "top_kernels": []}
    from torch.profiler import ProfilerActivity, profile
    pdl, kernels.USE_PDL = kernels.USE_PDL, False
    try:
        step()
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                step()
            sync(device)
    finally:
        kernels.USE_PDL = pdl
    per_name: dict[str, float] = {}
    n = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us() / reps
            n += 1
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {"kernels_us": sum(per_name.values()), "n_kernels": n / reps,
            "top_kernels": [(name[:60], round(us, 1)) for name, us in ranked]}


@torch.no_grad()
def time_block(block: M.Block, args: M.ModelArgs, kind: str, a, device, dtype, bw: float) -> list[dict]:
    rows = []
    C = args.kv_lora_rank + args.qk_rope_head_dim
    for ctx in a.ctx:
        cache = randn((1, ctx + max(a.T), C), device, dtype, seed=ctx)                   # [1, S, R+P]
        for T in a.T:
            s = step_inputs(args, T, ctx, a.tree, device, dtype, a.seed)
            step = layer_step(block, s, cache)
            ids = routed_ids(block, step)
            eager, graph, why = time_step(step, device, a.graph)
            cold = _cold_us(step, device) if graph is not None else None     # weights from HBM, as in a step
            compiled, why_c = (None, None)
            if a.compile:
                # the step compiled whole (one shape per (ctx, T)): inductor fuses the plain ops itself
                compiled, why_c = time_compiled(torch.compile(layer_step(block, s, cache), dynamic=False), device)
            kern = kernel_times(step, device)
            nbytes = step_bytes(block, ids, ctx, T, C * cache.element_size())
            best = min(t for t in (eager, graph, compiled) if t is not None)
            floor = nbytes["total"] / bw
            rows.append({"layer": kind, "ctx": ctx, "T": T, "tree": a.tree if T > 1 else None,
                         "experts": None if ids is None else int(ids.unique().numel()),
                         "experts_uniform": None if ids is None else
                         uniform_union(args.n_routed_experts, args.num_experts_per_tok, T),
                         "eager_us": eager * 1e6, "graph_us": None if graph is None else graph * 1e6,
                         "cold_us": cold, "graph_error": why,
                         "compile_us": None if compiled is None else compiled * 1e6,
                         "compile_error": why_c, "floor_us": floor * 1e6, "mbu": floor / best, "bytes": nbytes,
                         **kern})
    return rows


@torch.no_grad()
def time_head(cfg: dict, a, device, dtype, bw: float) -> list[dict]:
    """lm_head of one rank ([vocab/tp, hidden], bf16) for T tokens: its latency and byte floor."""
    V, D = cfg["vocab_size"] // a.tp, cfg["hidden_size"]
    W = randn((V, D), device, dtype, a.seed).mul_(D ** -0.5)
    rows = []
    for T in a.T:
        x = torch.randn(T, D, dtype=dtype, device=device)
        t = median_time(lambda: F.linear(x, W), device)
        rows.append({"T": T, "us": t * 1e6, "floor_us": W.numel() * W.element_size() / bw * 1e6})
    return rows


def _best_us(r: dict) -> float:
    return min(t for t in (r["eager_us"], r["graph_us"], r.get("compile_us")) if t is not None)


def project(rows: list[dict], head: list[dict], cfg: dict, a) -> tuple[list[dict], list[str]]:
    """The whole model from one layer: (n_layers - n_dense) x MoE layer + n_dense x dense layer + lm_head
    + collectives at a fixed cost each. Returns rows per (ctx, T) and the assumptions, as printed."""
    n_layers, n_dense = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    n_moe, n_coll = n_layers - n_dense, 2 * n_layers + 2
    cost = a.allreduce_us[0]
    comm_us = n_coll * cost if a.tp > 1 else 0.0
    no_dense = "" if any(r["layer"] == "dense" for r in rows) else "; dense layer not timed (--no-dense): counted as MoE"
    assumptions = [
        f"{n_layers} layers: {n_moe} MoE + {n_dense} dense, each timed as the block above at the same ctx and T "
        f"(best of eager, CUDA graph and torch.compile where timed){no_dense}",
        f"per-rank shapes at TP{a.tp}: one rank's step time is the model's step time (all ranks work in lockstep)",
        f"collectives: 2 all-reduces per layer (attention o_proj, MLP/MoE) + the embedding all-reduce + the lm_head "
        f"all-gather = {n_coll} x {cost:g} us = {n_coll * cost / 1e3:.2f} ms (--allreduce-us; "
        f"bench.py allreduce measures it)"
        + ("" if a.tp > 1 else "; TP1 has no collectives: counted as 0"),
        "lm_head: one rank's [vocab/tp, hidden] bf16 matmul, timed; the embedding lookup (T rows) is not counted",
        "not counted: the drafter forward, tree building, acceptance, KV commit, host round trips",
        "routing: random hidden states, so expert unions are near the uniform estimate; real siblings route alike"]
    head_by_T = {h["T"]: h for h in head}
    dense = {(r["ctx"], r["T"]): r for r in rows if r["layer"] == "dense"}
    out = []
    for r in (r for r in rows if r["layer"] == "moe"):
        d, h = dense.get((r["ctx"], r["T"]), r), head_by_T[r["T"]]
        layers_us = n_moe * _best_us(r) + n_dense * _best_us(d) + h["us"]
        floor_us = n_moe * r["floor_us"] + n_dense * d["floor_us"] + h["floor_us"]
        out.append({"ctx": r["ctx"], "T": r["T"], "step_ms": (layers_us + comm_us) / 1e3,
                    "layers_ms": layers_us / 1e3, "comm_ms": comm_us / 1e3, "floor_ms": floor_us / 1e3,
                    "floor_plus_comm_ms": (floor_us + comm_us) / 1e3})
    for p in out:      # the accept length a T-token verify needs to break even with AR (drafter excluded)
        ar = next((q for q in out if q["ctx"] == p["ctx"] and q["T"] == 1), None)
        p["ar_tokens_per_s"] = 1e3 / ar["step_ms"] if ar else None
        p["breakeven_accept"] = p["step_ms"] / ar["step_ms"] if ar else None
    return out, assumptions


def print_layers(rows: list[dict], head: list[dict], proj: list[dict], assumptions: list[str], bw: float) -> None:
    print0(table(["layer", "ctx", "T", "experts", "uniform", "eager us", "compile us", "graph us", "cold us",
                  "kernels us", "graph/kern", "kernels", "floor us", "MBU", "MB read"],
                 [[r["layer"], r["ctx"], r["T"], _f(r["experts"], "d"), _f(r["experts_uniform"]), _f(r["eager_us"]),
                   _f(r["compile_us"]), _f(r["graph_us"]), _f(r["cold_us"]), _f(r["kernels_us"]),
                   _f(r["graph_us"] / r["kernels_us"] if r["graph_us"] and r["kernels_us"] else None, ".2f"),
                   _f(r["n_kernels"], ".0f"), _f(r["floor_us"]), _f(100 * r["mbu"], ".1f") + "%",
                   _f(r["bytes"]["total"] / 1e6)] for r in rows]))
    for r in rows:
        if r["top_kernels"]:
            print0(f"  {r['layer']} ctx {r['ctx']} T {r['T']} top kernels (us/step): "
                   + "; ".join(f"{n} {us}" for n, us in r["top_kernels"]))
    print0(f"floor = bytes read / {bw / 1e9:.0f} GB/s copy bandwidth measured in this run; bytes = attention "
           f"weights + distinct routed experts (INT4 + scales, 3 matrices) + shared expert + router + KV "
           f"(ctx + T) x (kv_lora + rope) x dtype bytes (dense: attention + MLP + KV); MBU = floor / best time; graph: "
           f"replayed back to back (what fits stays in L2); cold: the graph after writing twice the L2, as in a step")
    errs = {r["graph_error"] for r in rows if r["graph_error"]}
    if errs:
        print0(f"CUDA graph capture failed: {'; '.join(errs)}")
    errs = {r["compile_error"] for r in rows if r["compile_error"]}
    if errs:
        print0(f"torch.compile failed: {'; '.join(errs)}")
    print0("lm_head per rank: " + ", ".join(f"T={h['T']}: {h['us']:.1f} us (floor {h['floor_us']:.1f})" for h in head))
    print0("\nprojection to the whole model, per decode/verify step:")
    for s in assumptions:
        print0(f"  * {s}")
    print0(table(["ctx", "T", "step ms", "layers ms", "comm ms", "floor ms", "floor+comm ms", "AR tok/s",
                  "break-even accept"],
                 [[p["ctx"], p["T"], _f(p["step_ms"], ".2f"), _f(p["layers_ms"], ".2f"), _f(p["comm_ms"], ".2f"),
                   _f(p["floor_ms"], ".3f"), _f(p["floor_plus_comm_ms"], ".2f"),
                   _f(p["ar_tokens_per_s"]) if p["T"] == 1 else "", _f(p["breakeven_accept"], ".2f")] for p in proj]))
    print0("break-even accept: the mean accept length a T-token verify step needs to match AR (T=1) tokens/s")


def _scale(a, device) -> str:
    return a.scale if a.scale != "auto" else ("real" if device.type == "cuda" else "tiny")


def _free(device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def bench_layers(a, device, dtype) -> dict:
    scale = _scale(a, device)
    cfg = k26_text_config(scale)
    nbytes = copy_size(a, device)
    bw = copy_bandwidth(device, nbytes)
    print0(f"\n## layers: K2.6 {scale} shapes, TP{a.tp} per-rank, {str(dtype).replace('torch.', '')} on {device}")
    print0(f"copy bandwidth: {bw / 1e9:.1f} GB/s (read + written, {nbytes / 2**20:.0f} MiB device-to-device copy)")
    print0(f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads'] // a.tp} heads/rank, "
           f"q_lora {cfg['q_lora_rank']}, "
           f"kv_lora {cfg['kv_lora_rank']}, rope {cfg['qk_rope_head_dim']}, {cfg['n_routed_experts']} experts top-"
           f"{cfg['num_experts_per_tok']} INT4 g32, expert inter {cfg['moe_intermediate_size'] // a.tp}/rank; "
           f"T > 1 verifies a {a.tree} tree (positions ctx + depth, ancestor mask)")
    rows, fusions = [], []
    for kind, layer_id in [("moe", 1)] + ([("dense", 0)] if a.dense else []):
        args, block = build_block(cfg, layer_id, a.tp, device, dtype, a.seed)
        rows += time_block(block, args, kind, a, device, dtype, bw)
        if a.fusions and kind == "moe":
            fusions = time_fusions(block, args, rows, a, device, dtype, bw)
        del block
        _free(device)
    head = time_head(cfg, a, device, dtype, bw)
    proj, assumptions = project(rows, head, cfg, a)
    print_layers(rows, head, proj, assumptions, bw)
    if fusions:
        print_fusions(fusions)
    if scale == "tiny":
        print0("(scale tiny: the projection only exercises the arithmetic; run --scale real on a GPU for numbers)")
    return {"scale": scale, "tp": a.tp, "dtype": str(dtype).replace("torch.", ""), "tree": a.tree,
            "copy_bandwidth_Bps": bw, "copy_bytes": nbytes, "allreduce_us": a.allreduce_us[0], "rows": rows,
            "lm_head": head, "projection": proj, "assumptions": assumptions, "fusions": fusions}


def time_fusions(block: M.Block, args: M.ModelArgs, rows: list[dict], a, device, dtype, bw: float) -> list[dict]:
    """--fusions: the MoE block with each of kernels.FUSE switched off in turn, against `rows` (all on): what each
    fusion saves in graph and cold-L2 time and in kernels per step."""
    out = []
    for name in kernels.FUSE:
        saved = dict(kernels.FUSE)
        kernels.FUSE[name] = False
        try:
            off = time_block(block, args, "moe", a, device, dtype, bw)
        finally:
            kernels.FUSE.update(saved)
        for on, o in zip([r for r in rows if r["layer"] == "moe"], off):
            out.append({"fusion": name, "ctx": on["ctx"], "T": on["T"],
                        **{f"{k}_{w}": r[k] for k in ("graph_us", "cold_us", "n_kernels") for w, r in
                           (("on", on), ("off", o))}})
    return out


def print_fusions(rows: list[dict]) -> None:
    def gain(r, k):
        return None if r[f"{k}_on"] is None or r[f"{k}_off"] is None else r[f"{k}_off"] - r[f"{k}_on"]
    print0("\nfusions (kernels.FUSE): the MoE block with each one off, against all on")
    print0(table(["fusion", "ctx", "T", "graph us on", "off", "saves", "cold us on", "off", "saves", "kernels on",
                  "off"],
                 [[r["fusion"], r["ctx"], r["T"], _f(r["graph_us_on"]), _f(r["graph_us_off"]),
                   _f(gain(r, "graph_us")), _f(r["cold_us_on"]), _f(r["cold_us_off"]), _f(gain(r, "cold_us")),
                   _f(r["n_kernels_on"], ".0f"), _f(r["n_kernels_off"], ".0f")] for r in rows]))


# ----------------------------------------------------------------------------------------------
# split: how to cut the routed experts across TP ranks (issue 8), and whether the drafter should be split too


def rand_experts(E: int, D: int, I: int, group_size: int, dtype, device) -> tuple:
    """Random INT4 experts (w13_packed, w13_scale, w2_packed, w2_scale): random words (every nibble 0..15 equally
    likely) and small positive scales."""
    w13_packed = torch.randint(-2**31, 2**31, (E, 2 * I, D // 8), dtype=torch.int32, device=device)
    w2_packed = torch.randint(-2**31, 2**31, (E, D, I // 8), dtype=torch.int32, device=device)
    w13_scale = (torch.rand(E, 2 * I, D // group_size, device=device) * 0.5 + 0.5).mul(1 / (7 * D**0.5)).to(dtype)
    w2_scale = (torch.rand(E, D, I // group_size, device=device) * 0.5 + 0.5).mul(1 / (7 * I**0.5)).to(dtype)
    return w13_packed, w13_scale, w2_packed, w2_scale


def _moe_call(x, ids, w, experts: tuple):
    """The routed experts as model.py runs them (Triton on CUDA, the reference elsewhere)."""
    module = C.int4_experts(*experts)
    return lambda: module(x, w, ids)


def int4_ref(x, topk_ids, topk_weights, *weights):
    """model.Experts.forward as written, on fused_moe_w4a16's arguments."""
    return M.Experts.forward.ref(C.int4_experts(*weights), x, topk_weights, topk_ids)


@torch.no_grad()
def bench_moe_split(a, device, dtype, n_routings: int = 3) -> dict:
    """Routed experts of one K2.6 MoE layer at TP a.tp, two ways, timed on this GPU as rank-sized problems:
    TP inside every expert (all E experts, I/tp columns each: every rank reads 1/tp of every routed expert) vs
    expert parallel (E/tp whole experts per rank: a rank reads only its own routed experts, whole). Under EP the
    step waits for the busiest rank, so its time is the max over ranks of the kernel on that rank's (token,
    expert) pairs. Both then need the same one all-reduce per layer, so it is left out."""
    cfg = k26_text_config(_scale(a, device))
    E, D, I, K, tp = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], \
        cfg["num_experts_per_tok"], a.tp
    assert E % tp == 0 and I % (tp * 32) == 0, f"E={E}, I={I} must split over tp={tp}"
    bw = copy_bandwidth(device, copy_size(a, device))
    tp_w = rand_experts(E, D, I // tp, 32, dtype, device)
    ep_w = rand_experts(E // tp, D, I, 32, dtype, device)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in ep_w)                 # one whole expert
    print0(f"\n## moe-split: {E} experts top-{K}, I={I}, D={D}, INT4 g32, TP{tp}: TP-in-expert (I/{tp} per rank) "
           f"vs EP ({E // tp} whole experts per rank); copy bandwidth {bw / 1e9:.0f} GB/s")
    g = torch.Generator().manual_seed(a.seed)
    rows = []
    for T in a.T:
        for r in range(n_routings):
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)      # [T, K]
            w = torch.rand(T, K, generator=g).to(device)
            x = torch.randn(T, D, generator=g).to(device, dtype)
            t_tp = median_time(_moe_call(x, ids, w, tp_w), device, graph=a.graph)
            per_rank, n_local = [], []
            for rk in range(tp):
                t_idx, k_idx = ((ids >= rk * E // tp) & (ids < (rk + 1) * E // tp)).nonzero(as_tuple=True)
                n_local.append(int(ids[t_idx, k_idx].unique().numel()))
                if len(t_idx) == 0:
                    per_rank.append(0.0)
                    continue
                # one row per local (token, expert) pair, K = 1: the same work as the rank's share of the layer
                call = _moe_call(x[t_idx].contiguous(), (ids[t_idx, k_idx] - rk * E // tp)[:, None].contiguous(),
                                 w[t_idx, k_idx][:, None].contiguous(), ep_w)
                per_rank.append(median_time(call, device, graph=a.graph))
            distinct = int(ids.unique().numel())
            rows.append({"T": T, "routing": r, "distinct_experts": distinct, "ep_max_experts": max(n_local),
                         "tp_us": t_tp * 1e6, "ep_max_us": max(per_rank) * 1e6,
                         "ep_mean_us": sum(per_rank) / tp * 1e6,
                         "tp_floor_us": distinct * expert_bytes / tp / bw * 1e6,
                         "ep_floor_us": max(n_local) * expert_bytes / bw * 1e6})
    print0(table(["T", "routing", "experts", "EP busiest rank", "TP us", "EP max us", "EP mean us", "TP floor us",
                  "EP floor us"],
                 [[r["T"], r["routing"], r["distinct_experts"], r["ep_max_experts"], _f(r["tp_us"]),
                   _f(r["ep_max_us"]), _f(r["ep_mean_us"]), _f(r["tp_floor_us"]), _f(r["ep_floor_us"])]
                  for r in rows]))
    print0("floor = bytes that rank reads / copy bandwidth; EP's step waits for its busiest rank")
    del tp_w, ep_w
    _free(device)
    return {"tp": tp, "copy_bandwidth_Bps": bw, "rows": rows}


@torch.no_grad()
def bench_allreduce(a, device, dtype, n_graph: int = 61) -> dict:
    """Under torchrun: one all-reduce of a [T, hidden] activation (what o_proj and the MoE each end with), eager
    and captured n_graph times back to back in one CUDA graph (as a whole-model graph replays them), per T.
    Collectives per layer = 2 (model.py), so a layer pays 2x this."""
    import torch.distributed as dist
    if M.world_size < 2:
        raise ValueError("bench.py allreduce needs torchrun with --nproc-per-node >= 2")
    D = k26_text_config(_scale(a, device))["hidden_size"]
    def per_call(fn, iters: int = 50) -> float:
        # a fixed number of calls on every rank: an adaptive timer (triton's do_bench picks its repetitions from
        # a first measurement) lets the ranks disagree on the count, and a collective then waits forever
        for _ in range(5):
            fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / iters

    rows = []
    for T in a.T:
        x = torch.randn(T, D, device=device, dtype=dtype)
        eager = per_call(lambda: dist.all_reduce(x))
        graph = None
        if device.type == "cuda" and a.graph:
            dist.all_reduce(x)                                   # NCCL's lazy init must happen outside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(n_graph):
                    dist.all_reduce(x)
            graph = per_call(g.replay, iters=10) / n_graph
        rows.append({"T": T, "eager_us": eager * 1e6, "graph_us": None if graph is None else graph * 1e6})
    print0(f"\n## allreduce: [T, {D}] {str(dtype)[6:]} across {M.world_size} ranks "
           f"({dist.get_backend()}); graph = {n_graph} captured back to back, per call")
    print0(table(["T", "eager us", "graph us", "per layer (2x) us"],
                 [[r["T"], _f(r["eager_us"]), _f(r["graph_us"]),
                   _f(2 * (r["graph_us"] if r["graph_us"] is not None else r["eager_us"]))] for r in rows]))
    return {"world_size": M.world_size, "hidden": D, "rows": rows}


@torch.no_grad()
def bench_draft(a, device, dtype) -> dict:
    """One drafter forward (block_size tokens + block_size new context rows, ctx cached) of the K2.6 DFlash
    drafter: replicated (every rank runs all of it) vs tensor-parallel per-rank shapes at a.tp plus its
    2 * layers + 1 all-reduces at --allreduce-us each."""
    cfg = k26_draft_config(_scale(a, device))
    args = C.draft_args(cfg)
    bw = copy_bandwidth(device, copy_size(a, device))
    rows = []
    for tp in sorted({1, a.tp}):
        with per_rank_build(tp, device, dtype):
            drafter = dflash.DFlashDrafter(args)
            C.randomize_(drafter, a.seed, prefix="draft.")
        nbytes = param_bytes(drafter)
        for ctx in a.ctx:
            drafter.setup_cache(1, ctx + 2 * args.block_size)
            block = torch.randn(1, args.block_size, args.hidden_size, device=device, dtype=dtype)
            feats = torch.randn(1, args.block_size, args.fc_in, device=device, dtype=dtype)
            ctx_len = torch.tensor([ctx], device=device)
            n_valid = torch.tensor([args.block_size], device=device)        # no padding rows
            step = lambda: drafter.cached_forward(block, feats, ctx_len, n_valid)
            t = median_time(step, device, graph=a.graph and device.type == "cuda")
            comm = (2 * args.num_hidden_layers + 1) * a.allreduce_us[0] if tp > 1 else 0.0
            rows.append({"tp": tp, "ctx": ctx, "weights_MB": nbytes / 1e6, "us": t * 1e6, "comm_us": comm,
                         "total_us": t * 1e6 + comm, "floor_us": nbytes / bw * 1e6})
        del drafter
        _free(device)
    print0(f"\n## draft: K2.6 DFlash drafter ({args.num_hidden_layers} layers, hidden {args.hidden_size}), one forward "
           f"of {args.block_size} block tokens + {args.block_size} new context rows; replicated vs TP{a.tp} per rank")
    print0(table(["TP", "ctx", "MB/rank", "forward us", "all-reduces us", "total us", "floor us"],
                 [[r["tp"], r["ctx"], _f(r["weights_MB"]), _f(r["us"]), _f(r["comm_us"]), _f(r["total_us"]),
                   _f(r["floor_us"])] for r in rows]))
    print0(f"all-reduces: {2 * args.num_hidden_layers + 1} per forward (fc, then o_proj and down_proj per layer) at "
           f"{a.allreduce_us[0]:g} us (--allreduce-us); the draft logits (target lm_head) are not included")
    return {"tp": a.tp, "copy_bandwidth_Bps": bw, "rows": rows}


# ----------------------------------------------------------------------------------------------
# peer: the same layer (and the e2e model) through transformers' DeepseekV3


# The name `kernels` is also Hugging Face's package of hub kernels, which transformers imports when it loads
# (`from kernels import ...` in transformers.integrations.hub_kernels). With the project root on sys.path that import
# would find kernels.py. The tests and `bench.py peer` load transformers through import_transformers() instead.

def import_transformers():
    """Import transformers with kernels.py out of the way: the project root off sys.path and no `kernels` in
    sys.modules while transformers binds Hugging Face's package, then kernels.py takes its name back. Hub kernels
    stay off (USE_HUB_KERNELS=0 unless set): transformers is our reference as plain PyTorch, and from_pretrained
    would otherwise import more of that package by kernels.py's name."""
    import importlib
    import sys
    os.environ.setdefault("USE_HUB_KERNELS", "0")
    if "transformers.integrations.hub_kernels" not in sys.modules:
        root = os.path.dirname(os.path.abspath(kernels.__file__))
        ours, path = sys.modules.pop("kernels", None), sys.path[:]
        sys.path[:] = [p for p in path if os.path.abspath(p or os.curdir) != root]
        try:
            importlib.import_module("transformers.integrations.hub_kernels")
        finally:
            sys.path[:] = path
            sys.modules.pop("kernels", None)
            if ours is not None:
                sys.modules["kernels"] = ours
    return importlib.import_module("transformers")


def hf_config(text_cfg: dict, tp: int, experts_impl: str):
    """transformers' DeepseekV3Config for rank 0's shapes at TP tp (the peer runs the per-rank problem)."""
    from transformers import DeepseekV3Config
    c = {k: v for k, v in text_cfg.items() if k not in ("model_type", "quantization_config", "architectures")}
    heads = c["num_attention_heads"] // tp
    c.update(num_attention_heads=heads, num_key_value_heads=heads,
             moe_intermediate_size=c["moe_intermediate_size"] // tp, intermediate_size=c["intermediate_size"] // tp)
    hc = DeepseekV3Config(**c)
    hc._attn_implementation = "sdpa"
    hc._experts_implementation = experts_impl
    return hc


@torch.no_grad()
def copy_block_to_hf(block: M.Block, layer) -> None:
    """Our block's weights into a DeepseekV3DecoderLayer: same names, except the routed experts, which are
    dequantized expert by expert into transformers' fused gate_up_proj [E, 2I, D] and down_proj [E, D, I]."""
    sd = {k: v for k, v in C.checkpoint_tensors(block).items() if ".experts." not in k}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not unexpected and all(".experts." in k for k in missing), (missing, unexpected)
    if not isinstance(block.mlp, M.MoE):
        return
    ex, hx = block.mlp.experts, layer.mlp.experts
    for e in range(hx.gate_up_proj.shape[0]):
        if ex.quant:
            gs = ex.quant.group_size
            hx.gate_up_proj[e].copy_(M.dequant_int4(ex.w13_packed[e], ex.w13_scale[e], gs))
            hx.down_proj[e].copy_(M.dequant_int4(ex.w2_packed[e], ex.w2_scale[e], gs))
        else:
            hx.gate_up_proj[e].copy_(ex.w13[e])
            hx.down_proj[e].copy_(ex.w2[e])


def hf_layer(block: M.Block, hc, layer_id: int, device, dtype):
    """A DeepseekV3DecoderLayer holding `block`'s weights, allocated without initialization (meta, then empty)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    layer = C.build(lambda: DeepseekV3DecoderLayer(hc, layer_id), "meta", dtype)
    layer = layer.to_empty(device=device).eval().requires_grad_(False)
    layer.self_attn.layer_idx = 0         # its cache below holds this one layer
    copy_block_to_hf(block, layer)
    return layer


def hf_cache(cache: torch.Tensor, ctx: int, R: int):
    """transformers' DynamicCache prefilled with the same ctx latents. It stores kv_a_layernorm(c_kv) and
    the roped k_pe, as ours does, but k_pe in the de-interleaved (evens then odds) order of its rope."""
    from transformers import DynamicCache
    kv, pe = cache[:, :ctx, :R], cache[:, :ctx, R:]
    pe = torch.cat([pe[..., 0::2], pe[..., 1::2]], dim=-1)
    hc = DynamicCache()
    hc.update(kv[:, None].contiguous(), pe[:, None].contiguous(), 0)        # [1, 1, ctx, R], [1, 1, ctx, P]
    return hc


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


@torch.no_grad()
def peer_rows(block, args, hlayer, hc, kind: str, a, device, dtype) -> list[dict]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    rotary = DeepseekV3RotaryEmbedding(hc).to(device)
    R, C = args.kv_lora_rank, args.kv_lora_rank + args.qk_rope_head_dim
    rows = []
    for ctx in a.ctx:
        cache = randn((1, ctx + max(a.T), C), device, dtype, seed=ctx)                   # [1, S, R+P]
        past = hf_cache(cache, ctx, R)
        for T in a.T:
            s = step_inputs(args, T, ctx, a.tree, device, dtype, a.seed)
            mask4 = torch.cat([torch.ones(1, 1, T, ctx, dtype=torch.bool, device=device), s["mask"][:, None]], -1)
            pos_emb = rotary(s["x"], s["positions"])

            def theirs():
                y = hlayer(s["x"], attention_mask=mask4, position_ids=s["positions"], past_key_values=past,
                           position_embeddings=pos_emb)
                past.crop(-T)           # back to ctx cached tokens: every call is the same step
                return y
            step = layer_step(block, s, cache, r=False)
            ours = lambda: sum_output(*step())          # the layer's output, as transformers' layer returns it
            err = rel_err(ours(), theirs())
            t_ours, t_graph, _ = time_step(ours, device, a.graph)
            t_peer = median_time(theirs, device)
            rows.append({"layer": kind, "ctx": ctx, "T": T, "ours_us": t_ours * 1e6,
                         "ours_graph_us": None if t_graph is None else t_graph * 1e6, "peer_us": t_peer * 1e6,
                         "speedup": t_peer / t_ours, "speedup_graph": None if t_graph is None else t_peer / t_graph,
                         "rel_err": err})
        del past
    return rows


@torch.no_grad()
def peer_e2e(a, device, dtype) -> dict:
    """Greedy AR decode of the e2e target: ours (generate.py) vs DeepseekV3ForCausalLM.generate, same weights
    (experts dequantized), same prompt; wall time of the whole call (prefill included) for both."""
    import generate as G
    from transformers import DeepseekV3ForCausalLM
    ckpt, _ = _e2e_paths(a)
    target = C.load_model(ckpt, device, dtype, progress=False)
    if param_bytes(target) > 2 * 2**30:
        gib = param_bytes(target) / 2**30
        return {"skipped": f"{ckpt}: {gib:.1f} GiB of weights; the peer e2e is for small models"}
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    hc = hf_config(cfg.get("text_config", cfg), 1, a.peer_experts)
    hf = C.build(lambda: DeepseekV3ForCausalLM(hc), "cpu", dtype).to(device).eval()
    for ours_layer, their_layer in zip(target.layers, hf.model.layers):
        copy_block_to_hf(ours_layer, their_layer)
    for dst, src in ((hf.model.embed_tokens, target.embed_tokens), (hf.model.norm, target.norm),
                     (hf.lm_head, target.lm_head)):
        dst.weight.copy_(src.weight)
    prompts = load_prompts(a.prompts, 1)
    ids = encode_prompts(prompts, a.tokenizer or ckpt, target.args.vocab_size, a.chat)[0][0]
    n = a.max_new_tokens
    inp = torch.tensor([ids], device=device)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(inp))
    ours = lambda k: G.generate(target, ids, k, max_seq_len=len(ids) + n + 8)
    theirs = lambda k: hf.generate(inp, max_new_tokens=k, min_new_tokens=k, **kw)[0, len(ids):].tolist()
    ours(4), theirs(4)                 # warm-up
    times, outs = {}, {}
    for name, fn in (("ours", ours), ("peer", theirs)):
        sync(device)
        t0 = time.perf_counter()
        outs[name] = fn(n)
        sync(device)
        times[name] = time.perf_counter() - t0
    return {"target": ckpt, "new_tokens": n, "ours_s": times["ours"], "peer_s": times["peer"],
            "ours_tokens_per_s": n / times["ours"], "peer_tokens_per_s": n / times["peer"],
            "speedup": times["peer"] / times["ours"], "same_tokens": outs["ours"] == outs["peer"]}


@torch.no_grad()
def bench_peer(a, device, dtype) -> dict:
    import_transformers()        # Hugging Face's `kernels` package, not ours, for transformers
    scale = _scale(a, device)
    cfg = k26_text_config(scale)
    print0(f"\n## peer: transformers DeepseekV3 vs ours, K2.6 {scale} shapes, TP{a.tp} per-rank, "
           f"{str(dtype).replace('torch.', '')} on {device}")
    print0(f"transformers: sdpa attention over its DynamicCache (compressed latents, decompressed every step), "
           f"experts '{a.peer_experts}' on {str(dtype).replace('torch.', '')} weights dequantized from our INT4; ours: "
           f"absorbed MLA over the static cache, INT4 MoE ({'triton' if use_triton(device) else 'reference'})")
    rows = []
    for kind, layer_id in [("moe", 1)] + ([("dense", 0)] if a.dense else []):
        args, block = build_block(cfg, layer_id, a.tp, device, dtype, a.seed)
        hc = hf_config(cfg, a.tp, a.peer_experts)
        hlayer = hf_layer(block, hc, layer_id, device, dtype)
        rows += peer_rows(block, args, hlayer, hc, kind, a, device, dtype)
        del block, hlayer
        _free(device)
    print0(table(["layer", "ctx", "T", "ours us", "ours graph us", "peer us", "speedup", "speedup (graph)", "rel err"],
                 [[r["layer"], r["ctx"], r["T"], _f(r["ours_us"]), _f(r["ours_graph_us"]), _f(r["peer_us"]),
                   _f(r["speedup"], ".2f"), _f(r["speedup_graph"], ".2f"), _f(r["rel_err"], ".1e")] for r in rows]))
    print0("speedup = peer time / our time (eager vs eager; '(graph)': ours in a CUDA graph); rel err: max |ours - "
           "peer| / max |peer| of the layer output (INT4 kernel vs bf16 dequantized matmul)")
    out = {"scale": scale, "tp": a.tp, "dtype": str(dtype).replace("torch.", ""), "experts_impl": a.peer_experts,
           "rows": rows}
    try:
        out["e2e"] = peer_e2e(a, device, dtype)
    except FileNotFoundError as e:
        out["e2e"] = {"skipped": str(e)}
    e = out["e2e"]
    if "skipped" in e:
        print0(f"peer e2e skipped: {e['skipped']}")
    else:
        print0(f"peer e2e, greedy AR, {e['new_tokens']} tokens of {e['target']}: ours {e['ours_tokens_per_s']:.1f} "
               f"tok/s, transformers {e['peer_tokens_per_s']:.1f} tok/s (wall, prefill included): speedup "
               f"{e['speedup']:.2f}x; same tokens: {e['same_tokens']}")
    return out


# ----------------------------------------------------------------------------------------------
# tree: the DDTree build of one step


def _tree_by_ops(logits, roots, budget: int) -> ddtree.Tree:
    """tree.build_tree_batched with the search in tensor ops (ddtree_search's reference), whatever the device."""
    lp, tok = ddtree.rank_tokens(logits, min(budget, logits.shape[-1]))
    return ddtree.Tree(*ddtree.ddtree_search.ref(lp, tok, roots, budget))


@torch.no_grad()
def bench_tree(a, device, dtype) -> dict:
    """Per budget: the tree build through tree.ddtree_search's tensor ops (its reference) and through its kernel
    (GPU only), each after tree.rank_tokens (log_softmax + vocabulary ranking, timed alone too), on random fp32
    draft logits [1, L, V]; CUDA-graph medians on a GPU (a step replays them so), wall-clock medians on a CPU."""
    L, V = a.tree_depth, a.vocab
    graph = device.type == "cuda" and a.graph
    use_kernel = use_triton(device)
    print0(f"\n## tree: draft logits [1, {L}, {V}] fp32 on {device}, "
           f"{'CUDA-graph' if graph else 'wall-clock'} medians")
    rows = []
    for B in a.budgets:
        g = torch.Generator(device=device).manual_seed(a.seed + B)
        logits = torch.randn(1, L, V, generator=g, device=device) * 3                  # [1, L, V]
        roots = torch.zeros(1, dtype=torch.long, device=device)
        r = {"budget": B, "depth": L, "vocab": V,
             "ops_us": median_time(lambda: _tree_by_ops(logits, roots, B), device, graph) * 1e6,
             "rank_us": median_time(lambda: ddtree.rank_tokens(logits, min(B, V)), device, graph) * 1e6,
             "kernel_us": None, "same": None}
        if use_kernel and B <= kernels.TREE_MAX_BUDGET:
            r["kernel_us"] = median_time(lambda: ddtree.build_tree_batched(logits, roots, B), device, graph) * 1e6
            got, want = ddtree.build_tree_batched(logits, roots, B), _tree_by_ops(logits, roots, B)
            pairs = [(getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(ddtree.Tree)]
            r["same"] = all(torch.equal(x, y) if x is not None else y is None for x, y in pairs)
        rows.append(r)
    print0(table(["budget", "tensor ops us", "search kernel us", "ranking us", "same tree"],
                 [[r["budget"], _f(r["ops_us"]), _f(r["kernel_us"]), _f(r["rank_us"]), r["same"]] for r in rows]))
    if not use_kernel:
        print0("(no GPU kernel here: build_tree_batched uses ddtree_search's tensor ops)")
    return {"graph": graph, "rows": rows}


def _event_median_us(fn, before, device, n: int = 100) -> float:
    """Median µs of fn() alone (CUDA events around it; before() runs untimed first), or wall clock on a CPU."""
    ts = []
    for _ in range(n):
        before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def graph_node_floor(device, sizes=(1, 10, 100, 200)) -> list[dict]:
    """What a CUDA-graph replay costs per kernel on this GPU, whatever the kernels do: a graph of N dependent
    one-element adds (~1 µs kernels). replay - kernel sum is the replay's own cost (a fixed part + a gap per node):
    the floor under any step made of short kernels."""
    import generate as G
    rows = []
    x = torch.zeros(1, device=device)
    for n in sizes:
        g = runner.capture_graph(lambda: [x.add_(1) for _ in range(n)])
        replay = _event_median_us(g.replay, lambda: None, device)
        k = kernel_times(g.replay, device)
        rows.append({"nodes": n, "replay_us": replay, "kernels_us": k["kernels_us"],
                     "ratio": replay / k["kernels_us"]})
    return rows


@torch.no_grad()
def bench_step(a, device, dtype) -> dict:
    """One decode step of the e2e pair (AR: --step-budgets 0; DDTree: B > 0), replayed many times from the same
    inputs, in each step mode: its time, the kernels it launches and their summed time (profiler; for a graph,
    inside the replay). time / kernel sum is what a mode adds on top of its kernels (issue 10: a CUDA graph
    should leave <= 1.2x); graph_node_floor is what this GPU adds per kernel to any graph."""
    import generate as G
    ckpt, draft_dir = _e2e_paths(a)
    target = C.load_model(ckpt, device, dtype, progress=False)
    drafter = C.load_drafter(draft_dir, target.args, device, dtype) if draft_dir else None
    ids = encode_prompts(load_prompts(a.prompts, 1), a.tokenizer or ckpt, target.args.vocab_size, a.chat)[0][0]
    modes = a.step_modes or (["static", "graph", "graph+compile"] if device.type == "cuda" else ["static"])
    print0(f"\n## step: {ckpt} on {device}, {str(dtype).replace('torch.', '')}, first prompt ({len(ids)} tokens), "
           f"one step replayed from the same inputs, medians of 100")
    rows = []
    for mode in modes:
        for budget in a.step_budgets:
            if budget and drafter is None:
                continue
            steps = runner.Steps()                # one step: this mode and budget
            G.generate(target, ids, 16, drafter=drafter if budget else None, budget=budget, mode=mode,
                       max_seq_len=len(ids) + 16 + 2 * (budget + 1) + 64, steps=steps)   # compiles / captures it
            (one,) = steps.values()
            restore = one.state.snapshot()
            step = lambda: one.launch(one.tree_step if budget else one.token_step)   # plain, compiled or captured
            restore(), step()
            first = one.state.out.clone()         # [1, N+1]: accept length, committed tokens
            us = _event_median_us(step, restore, device)
            same = torch.equal(one.state.out, first)     # every timed call was the same step
            k, k0 = kernel_times(lambda: (restore(), step()), device), kernel_times(restore, device)
            kern = None if k["kernels_us"] is None else k["kernels_us"] - k0["kernels_us"]
            rows.append({"mode": mode, "budget": budget, "us": us, "kernels_us": kern, "same_step": same,
                         "n_kernels": None if kern is None else k["n_kernels"] - k0["n_kernels"],
                         "ratio": us / kern if kern else None})
    print0(table(["mode", "step", "us", "kernels", "kernels us", "us / kernels us", "same step"],
                 [[r["mode"], step_name(r["budget"]), _f(r["us"]), _f(r["n_kernels"], ".0f"),
                   _f(r["kernels_us"]), _f(r["ratio"], ".2f"), r["same_step"]] for r in rows]))
    floor = graph_node_floor(device) if device.type == "cuda" else []
    if floor:
        print0("graph-node floor (a graph of N dependent one-element adds): " + "; ".join(
            f"N={f['nodes']}: replay {f['replay_us']:.1f} us over {f['kernels_us']:.1f} us of kernels "
            f"({f['ratio']:.2f}x)" for f in floor))
    return {"rows": rows, "graph_node_floor": floor}


# ----------------------------------------------------------------------------------------------
# kernels: the INT4 MoE and the MLA attention kernels against their references at K2.6 shapes on one GPU, with
# eager, CUDA-graph and cold-L2 timings; --sweep: their launch configs, one setting at a time


def _graph_us(fn, device, n: int = 25) -> float:
    """Median µs of replaying fn captured in a CUDA graph, one replay at a time."""
    import generate as G
    return _event_median_us(runner.capture_graph(fn).replay, lambda: None, device, n)


def _cold_us(fn, device) -> float:
    """µs of fn with a cold L2, as in a model step (each layer's cache and experts come from HBM once): a graph of
    [write twice the L2's size, fn] minus a graph of the write alone."""
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size // 4, dtype=torch.int32,
                        device=device)
    return _graph_us(lambda: (flush.fill_(1), fn()), device) - _graph_us(lambda: flush.fill_(1), device)


def mla_attention_work(T: int, H: int, keys: int, R: int, P: int, block_rows: int = 64) -> dict:
    """What one mla_attention call over `keys` cache slots must read and multiply: the cache bytes (bf16),
    the MMA flops of the scores (R + P per key) and of P @ V (R per key) for the T*H query rows, and the flops as
    the kernel runs them (whole blocks of `block_rows` query rows)."""
    rows, per_row = T * H, 2 * keys * (2 * R + P)
    padded = -(-rows // block_rows) * block_rows
    return dict(bytes=keys * (R + P) * 2, flops=rows * per_row, flops_executed=padded * per_row)


tl = kernels.tl                    # triton.language, for the read yardstick


@kernels.triton.jit
def _read_sum_kernel(x_ptr, out_ptr, N, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # the read yardstick: each program sums one contiguous chunk of x, so every byte is read once
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, CHUNK, BLOCK):
        offs = pid * CHUNK + i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def plain_read_us(x: torch.Tensor) -> float:
    """Cold-L2 µs of the fastest plain read of x over a few grids (4-16 programs an SM, 4096-8192 elements a
    step): the pace a memory-bound kernel reading x could at best keep."""
    n, best, total = x.numel(), float("inf"), x.float().sum()
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for per_sm in (4, 8, 16):
        for BLOCK in (4096, 8192):
            chunk = -(-(-(-n // (per_sm * sms))) // BLOCK) * BLOCK
            out = torch.empty(-(-n // chunk), device=x.device, dtype=torch.float32)
            fn = lambda: _read_sum_kernel[(out.numel(),)](x, out, n, CHUNK=chunk, BLOCK=BLOCK, num_warps=8)
            fn()
            torch.testing.assert_close(out.sum(), total, rtol=1e-3, atol=1.0)      # it did read all of x
            best = min(best, _cold_us(fn, x.device))
    return best


def _kernel_row(label: str, case, kernel, ref, tol: float, bw: float, device) -> dict:
    """case() -> (args, bytes read, extra columns: a string, or a function of the cold time): kernel vs reference
    error, eager / graph (L2 warm) / cold-L2 graph µs, GB/s of the cold time and its share of the copy bandwidth.
    An exception is reported on the row (and fails the run) instead of stopping the table."""
    try:
        args, nbytes, extra = case()
        a, b = kernel(*args).float(), ref(*args).float()
        rel = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        eager, graph = (median_time(lambda: kernel(*args), device, graph=g) * 1e6 for g in (False, True))
        cold = _cold_us(lambda: kernel(*args), device)
        gbps = nbytes / cold / 1e3
        head, tail = ("", extra(cold)) if callable(extra) else (extra, "")
        print0(f"{label}{head} {rel:>9.2e} {eager:>9.1f} {graph:>9.1f} {cold:>8.1f} {gbps:>7.0f} "
               f"{100 * gbps / bw:>5.1f}%{tail}{'' if rel < tol else '  FAIL'}")
        return {"case": label.split(), "rel_err": rel, "eager_us": eager, "graph_us": graph, "cold_us": cold,
                "ok": rel < tol}
    except Exception as exc:
        print0(f"{label}  ERROR {type(exc).__name__}: {str(exc)[:200]}")
        return {"case": label.split(), "error": str(exc)[:200], "ok": False}


@torch.no_grad()
def bench_kernels(a, device, dtype) -> dict:
    """The INT4 MoE (E = 384, D = 7168, top-8, group 32; I = 256, a TP8 slice, and 2048, whole experts) and the MLA
    attention (R = 512, P = 64, 8 and 64 heads, a random tree) at T = 1 .. 128 new tokens, kernel vs reference."""
    if a.resources:
        return kernel_resources()
    if device.type != "cuda" or not use_triton(device):
        print0("\n## kernels: needs a CUDA GPU and triton (tests/test_kernels.py checks the kernels on a CPU)")
        return {"skipped": "needs a CUDA GPU and triton"}
    if a.sweep:
        return kernel_sweep(device, dtype)
    bw = copy_bandwidth(device, 2**30) / 1e9                                                  # GB/s
    if a.linear:
        return linear_table(device, dtype, bw)
    tol, rows = 2e-2, []
    print0(f"\n## kernels: {torch.cuda.get_device_name(device)}, {dtype}, tol {tol}; copy bandwidth {bw:.0f} GB/s"
           f" ('% bw' = GB/s / that); graph: CUDA graph replayed back to back (inputs that fit stay in L2); cold:"
           f" after writing twice the L2, as in a model step; GB/s, % bw and TF/s from the cold time")
    print0(f"\nINT4 MoE: GB/s = INT4 weights + scales of the used experts / time; each T through both paths, the "
           f"GEMV and the tensor-core tiles (the model takes the GEMV below {kernels.MOE_MMA_MIN_PAIRS} (token, "
           f"expert) pairs)\n{'I':>5} {'T':>3} {'path':>4} {'experts':>7} {'rel err':>9} {'eager us':>9} "
           f"{'graph us':>9} {'cold us':>8} {'GB/s':>7} {'% bw':>6}")
    E, D, K, G = 384, 7168, 8, 32
    for I in (256, 2048):
        weights = rand_experts(E, D, I, G, dtype, device)
        expert_bytes = sum(w[0].numel() * w.element_size() for w in weights)
        for T, path in ((T, path) for T in (1, 9, 17, 33, 64, 128, 576) for path in ("gemv", "mma")):
            def case():
                x = torch.randn(T, D, device=device, dtype=dtype)
                x[0, 5] = 1e4 if T == 1 else x[0, 5]     # an outlier: fp16 activations must be scaled, not overflow
                topk_weights, topk_ids = torch.rand(T, E, device=device).topk(K, dim=-1)
                topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).float()
                n_exp = topk_ids.unique().numel()
                return (x, topk_ids, topk_weights, *weights), n_exp * expert_bytes, f" {n_exp:>7}"
            min_pairs, kernels.MOE_MMA_MIN_PAIRS = kernels.MOE_MMA_MIN_PAIRS, 10**9 if path == "gemv" else 0
            try:
                rows.append(_kernel_row(f"{I:>5} {T:>3} {path:>4}", case, kernels.fused_moe_w4a16,
                                        int4_ref, tol, bw, device))
            finally:
                kernels.MOE_MMA_MIN_PAIRS = min_pairs
        weights = None
        _free(device)

    a_ = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    peak = 2 * 8192**3 / median_time(lambda: a_ @ a_, device) / 1e12                          # TF/s, cuBLAS
    print0(f"\nMLA attention: B = 1, a random tree (packed mask rows); GB/s = cache bytes read ((prefix+T) x 576 x 2)"
           f" / time; MMA TF/s = flops as run (T*H rows in whole query blocks) / time; floor = max(bytes / copy "
           f"bandwidth, flops / {peak:.0f} TF/s, a bf16 8192^3 matmul)\n{'H':>3} {'T':>3} {'prefix':>7} "
           f"{'rel err':>9} {'eager us':>9} {'graph us':>9} {'cold us':>8} {'GB/s':>7} {'% bw':>6} {'MMA TF/s':>8} "
           f"{'floor us':>8} {'% floor':>7}")
    R, P, scale = 512, 64, 0.14468
    for H in (8, 64):                                   # TP8 heads per rank, all heads
        for T in (1, 9, 17, 33, 64):
            for prefix in (0, 1, 1000, 32768):
                def case():
                    q_lat = torch.randn(1, T, H, R, device=device, dtype=dtype)
                    q_pe = torch.randn(1, T, H, P, device=device, dtype=dtype)
                    cache = torch.randn(1, prefix + T + 5, R + P, device=device, dtype=dtype)
                    parents = torch.tensor([-1] + [int(torch.randint(0, t, ())) for t in range(1, T)])
                    mask = ancestor_mask(parents)[None].to(device)                             # [1, T, T]
                    wide = T * H >= kernels.ATTN_WIDE["min_rows"]
                    block = (kernels.ATTN_WIDE if wide else kernels.ATTN_BLOCKS)["BLOCK_Q"]
                    work = mla_attention_work(T, H, prefix + T, R, P, block)
                    floor = max(work["bytes"] / bw / 1e3, work["flops"] / peak / 1e6)         # µs

                    def columns(us):
                        return f" {work['flops_executed'] / us / 1e6:>8.0f} {floor:>8.1f} {100 * floor / us:>6.1f}%"
                    args = (q_lat, q_pe, cache, torch.tensor([prefix], device=device), mask, scale)
                    return args, work["bytes"], columns
                rows.append(_kernel_row(f"{H:>3} {T:>3} {prefix:>7}", case, kernels.mla_attention,
                                        M.mla_attention.ref, tol, bw, device))
    cache = torch.randn(1, 32768 + 17, R + P, device=device, dtype=dtype)
    us = plain_read_us(cache)
    print0(f"a plain read of a 32k-slot cache ({cache.numel() * 2 / 1e6:.1f} MB): {us:.1f} us cold, "
           f"{100 * cache.numel() * 2 / us / 1e3 / bw:.1f}% of the copy bandwidth")
    ok = all(r["ok"] for r in rows)
    print0("kernels:", "PASSED" if ok else "FAILED")
    return {"copy_GBps": bw, "mma_TFps": peak, "plain_read_32k_us": us, "rows": rows, "passed": ok}


LINEAR_SHAPES = {"q_a | kv_a": (2112, 7168), "q_b, W_UK in": (4608, 1536), "o_proj": (7168, 1024),
                 "shared gate | up": (512, 7168), "shared down": (7168, 256), "dense gate | up": (4608, 7168),
                 "dense down": (7168, 2304),
                 "lm_head": (20480, 7168)}    # [N, K] at TP8, rank 0: a MoE layer's five, the dense layer's, the head


def linear_table(device, dtype, bw: float) -> dict:
    """kernels.linear vs cuBLAS (F.linear) at T = 1 and 9 rows: µs per call in a CUDA graph of calls over copies of
    W that fill several L2s, so each reads its weight from HBM as in a step (and, where the GPU has it, each launch
    overlaps the one before as PDL lets it); floor = W's bytes / the copy bandwidth."""
    print0(f"\n## kernels --linear: {torch.cuda.get_device_name(device)}, {dtype}; copy bandwidth {bw:.0f} GB/s; "
           f"PDL {'on' if kernels._pdl(device)['PDL'] else 'off'}; skinny {kernels.SKINNY}")
    rows = []
    for name, (N, K) in LINEAR_SHAPES.items():
        copies = max(2, -(-(160 << 20) // (2 * N * K)))                       # >= 160 MiB: ~3 x the L2
        ws = [torch.randn(N, K, device=device, dtype=dtype) / K**0.5 for _ in range(copies)]
        for T in (1, 9):
            x = torch.randn(T, K, device=device, dtype=dtype)
            err = rel_err(kernels.linear(x, ws[0]), F.linear(x, ws[0]))
            ours, theirs = (_graph_us(lambda: [f(x, w) for w in ws], device) / copies
                            for f in (kernels.linear, F.linear))
            rows.append({"weight": name, "N": N, "K": K, "T": T, "rel_err": err, "us": ours, "cublas_us": theirs,
                         "floor_us": 2 * N * K / bw / 1e3})
        del ws
    print0(table(["weight", "N x K", "T", "rel err", "linear us", "cuBLAS us", "floor us", "linear GB/s"],
                 [[r["weight"], f"{r['N']} x {r['K']}", r["T"], f"{r['rel_err']:.1e}", _f(r["us"]), _f(r["cublas_us"]),
                   _f(r["floor_us"]), _f(2 * r["N"] * r["K"] / r["us"] / 1e3, ".0f")] for r in rows]))
    for T in (1, 9):
        five = [r for r in rows if r["T"] == T][:5]                  # LINEAR_SHAPES' first five: a MoE layer's
        print0(f"T = {T}, the MoE layer's five: linear {sum(r['us'] for r in five):.1f} us, cuBLAS "
               f"{sum(r['cublas_us'] for r in five):.1f} us, floor {sum(r['floor_us'] for r in five):.1f} us")
    return {"copy_GBps": bw, "skinny": dict(kernels.SKINNY), "rows": rows}


def kernel_resources(arch: int = 90) -> dict:
    """kernels --resources: the INT4 MoE kernels at their shipped settings, and the skinny GEMM at 16 rows,
    compiled for sm_{arch} by Triton's own compiler, no GPU needed (its ptxas and cuobjdump): registers, spilled stack and shared memory per program, and
    whether the tensor-core path's dots became wgmma (HGMMA) or mma.sync (HMMA), and the instructions a thread issues
    in its main loop (the longest innermost loop), shared-memory loads (LDS) among them. Pointers and the integer
    arguments that are multiples of 16 at K2.6's TP8 shapes are compiled as such, as the launch specializes them.
    Spills, wgmma and the loop's length decide much of a kernel's speed before it runs."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "{}")
    # "i32:16": an integer that is a multiple of 16 at K2.6's TP8 shapes (the launch specializes it as such)
    gemv = dict(xk_ptr="*i32", xs_ptr="*fp32", w_ptr="*i32", s_ptr="*bf16", pair_ptr="*i64", slots_ptr="*i64")
    mma = dict(a_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", topk_w_ptr="*fp32", out_ptr="*fp32", pair_ptr="*i64",
               slots_ptr="*i64", N="i32:16", K="i32:16", A_STRIDE="i32:16", ROWS_PER="i32")
    cases = [("GEMV gate | up", kernels._moe_gate_up_gemv, "gate_up", kernels.MOE_GEMV_BLOCKS,
              dict(gemv, gu_ptr="*fp32", I="i32:16", K="i32", P="i32", DW="i32:16", DG="i32:16"),   # K: top-k
              dict(SPLIT_K=2, EVEN=True)),
             ("GEMV down", kernels._moe_down_gemv, "down", kernels.MOE_GEMV_BLOCKS,
              dict(gemv, hk_ptr="*i32", hs_ptr="*fp32", topk_w_ptr="*fp32", y_ptr="*fp32", D="i32:16", IW="i32:16",
                   IG="i32"), dict(EVEN=True)),
             ("tensor-core gate | up", kernels._moe_mma_kernel, "gate_up", kernels.MOE_MMA_BLOCKS,
              dict(mma, out_ptr="*bf16"), dict(GATE_UP=True, S_PAIRS=True, BLOCK_M=16)),    # out: h, in x's dtype
             ("tensor-core down", kernels._moe_mma_kernel, "down", kernels.MOE_MMA_BLOCKS, mma,
              dict(GATE_UP=False, S_PAIRS=True, BLOCK_M=16))]
    skinny = dict(x_ptr="*bf16", w_ptr="*bf16", part_ptr="*fp32", y_ptr="*bf16", count_ptr="*i32", N="i32:16",
                  K="i32:16")
    cases.append(("skinny GEMM", kernels._skinny_kernel, "", {"": kernels.SKINNY}, skinny,
                  dict(SPLIT=4, BLOCK_M=16, IEEE=False)))
    rows = []
    for label, fn, key, blocks, sig, consts in cases:
        cfg = dict(blocks[key])
        options = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
        cfg = {k: v for k, v in cfg.items() if k in fn.arg_names}
        consts = dict(consts, **cfg, **{k: v for k, v in (("GROUP", 32), ("PDL", False), ("PTX", True))
                                        if k in fn.arg_names})
        params = [n for n in fn.arg_names if n not in consts]
        sig = {n: sig.get(n, "i32") for n in params}
        aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in params
                   if sig[n].startswith("*") or sig[n].endswith(":16")}
        sig = {n: t.removesuffix(":16") for n, t in sig.items()} | {n: "constexpr" for n in consts}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned),
                           target=GPUTarget("cuda", arch, 64), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage, sass = (subprocess.run([tool.format(name), flag, f.name], capture_output=True, text=True).stdout
                           for name, flag in (("cuobjdump", "-res-usage"), ("nvdisasm", "-c")))
        regs, stack = (int(re.search(rf"{w}:(\d+)", usage).group(1)) for w in ("REG", "STACK"))
        loop = _sass_main_loop(sass)
        rows.append({"kernel": label, "settings": blocks[key], "registers": regs, "stack_bytes": stack,
                     "shared_bytes": k.metadata.shared, "wgmma": sass.count("HGMMA"), "mma_sync": sass.count("HMMA"),
                     "loop_instructions": len(loop),
                     "loop_lds": sum(re.sub(r"^@!?U?P\w+\s+", "", i).split(".")[0].split()[0] == "LDS" for i in loop)})
    print0(f"\n## kernels --resources: compiled for sm_{arch} (triton {triton.__version__}), nothing run")
    print0(table(["kernel", "registers", "spilled stack B", "shared B", "HGMMA", "HMMA", "loop instr", "of which LDS"],
                 [[r["kernel"], r["registers"], r["stack_bytes"], r["shared_bytes"], r["wgmma"], r["mma_sync"],
                   r["loop_instructions"], r["loop_lds"]] for r in rows]))
    return {"arch": arch, "rows": rows}


def _sass_main_loop(sass: str) -> list[str]:
    """nvdisasm's listing -> the instructions of its longest innermost loop (a K loop: from a label to the last branch
    back to it, with no such loop inside)."""
    import re
    instrs, at, spans = [], {}, {}
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            at[label.group(1)] = len(instrs)
        elif re.match(r"\s*/\*[0-9a-f]+\*/", line):
            instrs.append(line.split("*/", 1)[1].strip())
            back = re.search(r"BRA\b.*`?\(?\.(L_x_\d+)", line)
            if back and back.group(1) in at:
                spans[at[back.group(1)]] = len(instrs)
    inner = [(b - a, a) for a, b in spans.items() if not any(a <= c and d <= b and (c, d) != (a, b)
                                                             for c, d in spans.items())]
    n, start = max(inner, default=(0, 0))
    return instrs[start:start + n]


def kernel_sweep(device, dtype) -> dict:
    """Launch configs at K2.6 TP8 shapes (CUDA-graph medians, µs): one setting changed at a time from the default."""
    from triton.testing import do_bench_cudagraph
    out = []

    def run(table, key, options, cases):
        default = dict(table[key])
        for opt in options:
            table[key] = dict(default, **opt)              # the launchers read these tables at call time
            try:
                times = [do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3 for fn in cases.values()]
            except Exception as exc:
                times = [f"ERROR {type(exc).__name__}: {str(exc)[:80]}"]
            print0(f"  {key:11} {str(opt):64} " + " ".join(f"{t:8.1f}" if isinstance(t, float) else t for t in times))
            out.append({"table": key, "setting": opt, "us": times})
        table[key] = default

    E, D, K = 384, 7168, 8
    moe = {}
    for I, Ts in ((256, (1, 9)), (2048, (9, 17))):     # TP8 slice (latency regime), whole experts on one GPU
        weights = rand_experts(E, D, I, 32, dtype, device)
        for T in Ts:
            x = torch.randn(T, D, device=device, dtype=dtype)
            w, ids = torch.rand(T, E, device=device).topk(K, dim=-1)
            moe[(I, T)] = (lambda a: lambda: kernels.fused_moe_w4a16(*a))((x, ids, w.float().contiguous(), *weights))
    print0(f"\n## kernels --sweep\nINT4 MoE (GEMV path), us at (I, T) = {list(moe)}; defaults "
           f"{kernels.MOE_GEMV_BLOCKS}")
    grid = [dict(BLOCK_N=n, BLOCK_W=w, num_warps=nw, num_stages=st)
            for n in (8, 16, 32, 64) for w in (32, 64, 128) for nw in (4, 8) for st in (2, 3)]
    run(kernels.MOE_GEMV_BLOCKS, "gate_up", grid, moe)
    run(kernels.MOE_GEMV_BLOCKS, "down", grid, moe)
    del weights, moe
    _free(device)
    weights, moe = rand_experts(E, D, 256, 32, dtype, device), {}
    for T in (64, 576):                                  # one tree of 64 nodes; B = 64 trees of 9
        x = torch.randn(T, D, device=device, dtype=dtype)
        w, ids = torch.rand(T, E, device=device).topk(K, dim=-1)
        moe[(256, T)] = (lambda a: lambda: kernels.fused_moe_w4a16(*a))((x, ids, w.float().contiguous(), *weights))
    print0(f"\nINT4 MoE (tensor-core path), us at (I, T) = {list(moe)}; defaults {kernels.MOE_MMA_BLOCKS}")
    grid = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=nw, num_stages=st)
            for n in (64, 128) for k in (64, 128, 256) for nw in (4, 8) for st in (2, 3, 4)]
    min_pairs, kernels.MOE_MMA_MIN_PAIRS = kernels.MOE_MMA_MIN_PAIRS, 0
    try:
        run(kernels.MOE_MMA_BLOCKS, "gate_up", grid, moe)
        run(kernels.MOE_MMA_BLOCKS, "down", grid, moe)
    finally:
        kernels.MOE_MMA_MIN_PAIRS = min_pairs
    del weights, moe
    _free(device)

    R, P, attn = 512, 64, {}
    for H, T, prefix in ((8, 1, 32768), (8, 9, 32768), (8, 17, 32768), (8, 33, 32768), (64, 9, 4096)):
        args = (torch.randn(1, T, H, R, device=device, dtype=dtype), torch.randn(1, T, H, P, device=device, dtype=dtype),
                torch.randn(1, prefix + T, R + P, device=device, dtype=dtype), torch.tensor([prefix], device=device),
                torch.ones(1, T, T, dtype=torch.bool, device=device).tril(), 0.14468)
        attn[(H, T, prefix)] = (lambda a: lambda: kernels.mla_attention(*a))(args)
    print0(f"MLA attention, us at (H, T, prefix) = {list(attn)}; defaults {kernels.ATTN_BLOCKS} "
           f"{kernels.ATTN_SPLITS} {kernels.ATTN_WIDE}")
    grid = [dict(BLOCK_Q=q, BLOCK_S=bs, num_warps=nw, num_stages=st)
            for q in (16, 32) for bs in (16, 32, 64) for nw in (4, 8) for st in (1, 2, 3)]
    run(vars(kernels), "ATTN_BLOCKS", grid, attn)
    splits = [dict(max_splits=m, min_split_len=n, waves=w) for m in (64, 256) for n in (64, 128, 256) for w in (1, 2, 4)]
    run(vars(kernels), "ATTN_SPLITS", splits, attn)
    return {"sweep": out}


# ----------------------------------------------------------------------------------------------
# Output: JSON and the plot


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print0("matplotlib not installed: skipping the plot (pip install matplotlib)")
        return None
    runs = result.get("e2e", {}).get("runs")
    if not runs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for temp in sorted({r["temperature"] for r in runs}):
        dd = [r for r in runs if r["mode"] == "ddtree" and r["temperature"] == temp]
        for ax, key in zip(axes, ("mean_accept", "tokens_per_s")):
            line = ax.plot([r["budget"] for r in dd], [r[key] for r in dd], marker="o", label=f"DDTree, T={temp:g}")
            for r in runs:
                if r["mode"] in ("ar", "chain") and r["temperature"] == temp:
                    ax.axhline(r[key], color=line[0].get_color(), ls=":" if r["mode"] == "ar" else "--",
                               label=f"{'autoregressive' if r['mode'] == 'ar' else 'DFlash chain'}, T={temp:g}")
    for ax, label in zip(axes, ("mean accept length (tokens per verify step)", "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DDTree node budget")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['e2e']['target']} ({result['env']['gpu'] or 'CPU'})", fontsize=9)
    fig.tight_layout()
    with files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def plot_path(out: str) -> str:
    """The plot written beside the JSON --out."""
    return os.path.splitext(out)[0] + ".png"


def write_out(result: dict, path: str) -> None:
    """The JSON, then its plot, each replacing its file whole: a failed write (a full disk) leaves the old
    file and is one line naming --out."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.write_json(path, result, indent=1)
        png = plot(result, plot_path(path))
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write the results ({e.strerror or e})") from None
    print0(f"\nwrote {path}" + (f" and {png}" if png else ""))


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    device = cli.init_distributed(device=a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    kernels.ENABLED = not a.no_triton
    torch.manual_seed(a.seed)
    env = environment(sys.argv if argv is None else ["bench.py", *argv], device)
    print_header(env)
    result = {"bench": "nano-ddtree", "mode": a.mode, "env": env,
              "args": {k: v for k, v in vars(a).items()}}
    modes = ["e2e", "layers", "peer"] if a.mode == "all" else [a.mode]
    for mode in modes:
        if mode not in ("e2e", "allreduce") and M.world_size > 1:
            result[mode] = {"skipped": "single-process mode: run it without torchrun"}
            print0(f"\n## {mode}: skipped under torchrun (single-process mode)")
            continue
        fn = {"e2e": bench_e2e, "layers": bench_layers, "moe-split": bench_moe_split, "draft": bench_draft,
              "allreduce": bench_allreduce, "peer": bench_peer, "tree": bench_tree, "step": bench_step,
              "kernels": bench_kernels}[mode]
        if mode == "e2e" and a.one_rank_of is not None:
            fn = bench_one_rank
        elif mode == "e2e" and a.batch:
            fn = bench_batch
        try:
            result[mode] = fn(a, device, dtype)
        except FileNotFoundError as e:
            if a.mode != "all":
                raise
            result[mode] = {"skipped": str(e)}
            print0(f"\n## {mode}: skipped: {e}")
    if a.out and M.rank == 0:
        write_out(result, a.out)
    print0(json.dumps(result))
    cli.close_distributed()
    return result


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _budgets(s: str) -> list:
    return [x.strip() if x.strip() == "auto" else int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("mode", choices=["e2e", "step", "layers", "moe-split", "draft", "allreduce", "peer", "tree", "kernels",
                                    "all"])
    p.add_argument("--batch", type=_ints, default=[], help="e2e: batch sizes (e.g. 1,4,16,64): batched decoding")
    p.add_argument("--step-mode", choices=["eager", "static", "graph", "compile", "graph+compile"], default="eager",
                   help="e2e decode loop: the eager reference, the fixed-shape step, that step as a CUDA graph, or compiled")
    e = p.add_argument_group("e2e (and the peer's e2e)")
    e.add_argument("--ckpt", default=None, help="target checkpoint dir (default: the bundled checkpoints/tiny-k2), "
                   "or random:k2.6 / random:tiny: K2.6's shapes with random weights, no checkpoint")
    e.add_argument("--draft", default=None, help="DFlash drafter dir (default: the bundled one with the bundled "
                                                 "target, random:<name>-dflash with random:<name>; '' for AR only)")
    e.add_argument("--tokenizer", default=None, help="dir with tiktoken.model (default: --ckpt)")
    e.add_argument("--prompts", default=PROMPTS_FILE, help="prompt set (JSON: {prompts: [{category, text}]}), or a "
                   "held-out file list (.txt, e.g. checkpoints/heldout_files.txt: windows of those stdlib files)")
    e.add_argument("--n-prompts", type=int, default=0, help="use the first N prompts (0: all)")
    e.add_argument("--budgets", type=_budgets, default=[1, 2, 4, 8, 16, 32, 64],
                   help="DDTree node budgets; auto: generate.py's --budget auto (e.g. auto,8)")
    e.add_argument("--temperature", type=_floats, default=[0.0, 1.0], help="comma-separated, e.g. 0 or 0,1")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--max-seq-len", type=int, default=0, help="KV cache length (0: longest prompt + new + tree)")
    e.add_argument("--warmup", type=int, default=-1, help="warm-up tokens per mode, on the longest prompt, "
                                                         "before timing (-1: --max-new-tokens; 0: none)")
    e.add_argument("--chat", action="store_true", help="apply the chat template (real K2.6) instead of raw text")
    e.add_argument("--no-chain", action="store_true", help="skip the DFlash chain baseline")
    e.add_argument("--bound", action="store_true", help="also the accept of a perfect drafter (the target drafting "
                   "for itself) at each DDTree budget and temperature")
    o = p.add_argument_group("e2e --one-rank-of N: rank 0 of tensor-parallel size N on one device, collectives NOT run")
    o.add_argument("--one-rank-of", type=int, default=None, metavar="N",
                   help="build rank 0's exact shapes of TP N in this one process (no process group) and time the real "
                   "decoding step (AR, and DDTree or auto at each --budgets; synthetic prompts of each --ctx tokens). The "
                   "collectives do NOT run: each is a no-op that counts its calls; their cost is projected at "
                   "--allreduce-us per call")
    o.add_argument("--allreduce-gbps", type=float, default=360.0,
                   help="--one-rank-of: a collective's bus bandwidth in GB/s for the projection (ring bytes per rank "
                   "= message x 2(N-1)/N), beside --allreduce-us per call")
    o.add_argument("--accept", type=_floats, default=[4.48, 5.3],
                   help="--one-rank-of: accept lengths (tokens per DDTree step) to project tok/s at")
    s = p.add_argument_group("step (the e2e pair and its first prompt)")
    s.add_argument("--step-budgets", type=_ints, default=[0, 8], help="step: 0 = the AR step, B > 0 = DDTree B")
    s.add_argument("--step-modes", type=lambda v: v.split(","), default=None,
                   help="step: comma-separated step modes (default: static,graph,graph+compile on CUDA, static on CPU)")
    l = p.add_argument_group("layers / peer")
    l.add_argument("--scale", choices=["auto", "real", "tiny"], default="auto", help="auto: real on CUDA, tiny on CPU")
    l.add_argument("--tp", type=int, default=8, help="per-rank shapes of this tensor-parallel size (rank 0)")
    l.add_argument("--ctx", type=_ints, default=None,
                   help="cached tokens (default real 512,4096,32768; tiny 128,1024); e2e --one-rank-of: synthetic "
                   "prompt lengths (default 4096,32768 on CUDA, 128 on the CPU)")
    l.add_argument("--T", type=_ints, default=[1, 9, 17, 33], help="new tokens per step (T > 1: tree verify)")
    l.add_argument("--tree", choices=["random", "chain"], default="random", help="tree shape for T > 1")
    l.add_argument("--no-dense", dest="dense", action="store_false", help="skip the dense layer-0 block")
    l.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph timings")
    l.add_argument("--compile", action="store_true", help="layers: also time torch.compile of each block")
    l.add_argument("--fusions", action="store_true",
                   help="layers: also time the MoE block with each fusion of kernels.FUSE off, one at a time")
    l.add_argument("--allreduce-us", type=_floats, default=[25.0],
                   help="cost of one collective in the projection, us (a stated figure, not a measurement: "
                   "torchrun ... bench.py allreduce measures it); e2e --one-rank-of takes several, e.g. 20,10")
    l.add_argument("--copy-mb", type=int, default=0, help="size of the bandwidth copy (0: 2048 on CUDA, 128 on CPU)")
    l.add_argument("--peer-experts", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"],
                   help="transformers' experts implementation (grouped_mm is its default for models)")
    k = p.add_argument_group("kernels")
    k.add_argument("--sweep", action="store_true", help="kernels: sweep the MoE and attention launch configs instead")
    k.add_argument("--resources", action="store_true", help="kernels: the MoE kernels compiled for sm_90 (no GPU "
                   "needed): registers, spills, shared memory, wgmma")
    k.add_argument("--linear", action="store_true",
                   help="kernels: only the skinny GEMM (kernels.linear) vs cuBLAS and the copy floor at TP8 shapes")
    t = p.add_argument_group("tree")
    t.add_argument("--vocab", type=int, default=163840, help="tree: vocabulary size of the draft logits (Kimi's)")
    t.add_argument("--tree-depth", type=int, default=7, help="tree: depths L (block_size - 1)")
    c = p.add_argument_group("common")
    c.add_argument("--device", default=None, help=M.DEVICE_HELP)
    c.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--no-triton", action="store_true", help="force the PyTorch reference kernels")
    c.add_argument("--out", default=None, help="write the JSON here (and a PNG plot next to it)")
    a = p.parse_args(argv)
    if a.one_rank_of is not None:
        check_one_rank_args(p, a)
    if a.ctx is None:
        a.ctx = [128, 1024] if a.scale == "tiny" or (a.scale == "auto" and not torch.cuda.is_available()) \
            else [512, 4096, 32768]
    if len(a.allreduce_us) != 1 and a.one_rank_of is None:
        p.error(f"--allreduce-us: one cost (several only with e2e --one-rank-of), got {a.allreduce_us}")
    if min(a.T) < 1 or max(a.T) > 64:
        p.error(f"--T values must lie in [1, 64] (the tree kernel's mask word), got {a.T}")
    if a.tp < 1:
        p.error(f"--tp must be >= 1, got {a.tp}")
    finite = lambda x: x == x and abs(x) != float("inf")
    step_modes = ("eager", "static", "graph", "compile", "graph+compile")
    for flag, ok, want, got in [
            ("--batch", all(b >= 1 for b in a.batch), "batch sizes >= 1", a.batch),
            ("--n-prompts", a.n_prompts >= 0, ">= 0 (0: all)", a.n_prompts),
            ("--temperature", a.temperature and all(map(verify.temperature_ok, a.temperature)),
             f"{verify.TEMPERATURE_RULE} (each value)", a.temperature),
            ("--budgets", bool(a.budgets), "at least one budget", a.budgets),
            ("--max-new-tokens", a.max_new_tokens >= 1, ">= 1", a.max_new_tokens),
            ("--max-seq-len", a.max_seq_len >= 0, ">= 0 (0: as long as needed)", a.max_seq_len),
            ("--warmup", a.warmup >= -1, ">= -1", a.warmup),
            ("--step-budgets", a.step_budgets and min(a.step_budgets) >= 0, "budgets >= 0", a.step_budgets),
            ("--step-modes", all(m in step_modes for m in a.step_modes or []), f"among {step_modes}", a.step_modes),
            ("--ctx", a.ctx and min(a.ctx) >= 1, "cached token counts >= 1", a.ctx),
            ("--allreduce-us", all(finite(c) and c >= 0 for c in a.allreduce_us), "finite numbers >= 0",
             a.allreduce_us),
            ("--copy-mb", a.copy_mb >= 0, ">= 0 (0: the default size)", a.copy_mb),
            ("--vocab", a.vocab >= 2, ">= 2", a.vocab), ("--tree-depth", a.tree_depth >= 1, ">= 1", a.tree_depth),
            ("--seed", 0 <= a.seed < 2**63, "in [0, 2^63)", a.seed)]:
        if not ok:
            p.error(f"{flag} must be {want}, got {got}")
    if any(b != "auto" and b < 1 for b in a.budgets):
        p.error(f"--budgets must be >= 1 or auto, got {a.budgets}")
    if "auto" in a.budgets and a.mode != "e2e":
        p.error("--budgets auto: e2e only")
    if not os.path.isfile(a.prompts):
        p.error(f"--prompts {a.prompts}: expected a prompt set file (JSON, or a .txt list of held-out files)")
    if not a.prompts.endswith(".txt"):
        try:
            read_prompt_set(a.prompts)
        except (OSError, ValueError) as e:
            p.error(f"--prompts {e}")
    if a.out is not None:   # checked before any work, not after it (the JSON, then the plot next to it)
        if os.path.splitext(a.out)[1].lower() == ".png":
            p.error(f"--out {a.out}: the plot is written next to the JSON as <name>.png; name the JSON <name>.json")
        try:
            paths = _e2e_paths(a)
        except FileNotFoundError:
            paths = ()                # bench_e2e names the missing checkpoint
        inputs = (a.prompts, a.tokenizer, *paths)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            cli.check_output_path("--out", a.out, inputs)
            cli.check_output_path(f"--out {a.out}: its plot", plot_path(a.out), inputs)
        except (OSError, ValueError) as e:
            p.error(str(e) if isinstance(e, ValueError) else f"--out {a.out}: cannot create its directory ({e})")
    return a


def check_one_rank_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--one-rank-of's flags, checked before anything loads; the TP size against the target's and the drafter's
    config (model.check_tp_divisibility, M.check_tp_divisibility). A bad value ends in p.error (exit 2)."""
    n = a.one_rank_of
    if n < 1:
        p.error(f"--one-rank-of must be a tensor-parallel size >= 1, got {n}")
    if a.mode != "e2e":
        p.error("--one-rank-of: e2e only")
    if not a.allreduce_gbps > 0 or a.allreduce_gbps == float("inf"):
        p.error(f"--allreduce-gbps: a finite bandwidth > 0, got {a.allreduce_gbps}")
    if a.max_new_tokens < 2:
        p.error(f"--one-rank-of: --max-new-tokens must be >= 2 (the first token comes from prefill; the steps "
                f"follow), got {a.max_new_tokens}")
    if not a.accept or min(a.accept) < 1:
        p.error(f"--accept: tokens per step, each >= 1, got {a.accept}")
    if a.ctx is None:
        cpu = (a.device or "").startswith("cpu") or not torch.cuda.is_available()
        a.ctx = [128] if cpu else [4096, 32768]
    if min(a.ctx) < 1:
        p.error(f"--ctx: prompt lengths >= 1, got {a.ctx}")
    try:
        ckpt, draft = _e2e_paths(a)
    except FileNotFoundError:
        return                        # bench_e2e names the missing checkpoint
    try:
        M.check_tp_divisibility(C.model_args(ckpt), n)
        if draft is not None:
            M.check_tp_divisibility(C.draft_args(draft), n)
    except ValueError as e:
        p.error(f"--one-rank-of {n}: {e}")


if __name__ == "__main__":
    sys.exit(cli.exit_code(main))    # a missing checkpoint, a bad file: one line, as generate.py
