"""Does the quick check catch every one-line break of the step? Each mutant below is one edited line
that breaks one invariant the README promises; each runs against `python -m pytest -q -m quick -x`
in a temporary copy of the repository (its files as the working tree has them), and
must fail it. Not part of CI: it runs the quick check once per mutant.

    python tools/mutants.py              # every mutant: caught / total, and the ones that survived
    python tools/mutants.py -k chain     # the mutants whose invariant or file mentions 'chain'
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (file, the line as it is (stripped), the line as the mutant has it, the invariant it breaks)
MUTANTS = [
    ("verify.py", "ok = (tree.ancestor_mask[:, :, 1:] <= match[:, None, 1:]).all(dim=-1)           # [B, N]",
     "ok = (tree.ancestor_mask[:, :, 1:] <= match[:, None, 1:]).any(dim=-1)           # [B, N]",
     "acceptance: a node is accepted when any ancestor matches, not all"),
    ("verify.py", "bonus = target_tokens.gather(1, deepest).squeeze(1)                             # [B]",
     "bonus = target_tokens.gather(1, deepest.clamp(max=0)).squeeze(1)                             # [B]",
     "acceptance: the bonus is the target's token after the root, not after the deepest accepted node"),
    ("tree.py", "keep = best.sort(dim=1).values                                  # [b, n_keep] tuple order",
     "keep = best                                  # [b, n_keep] tuple order",
     "tree shape: survivors in score order, not rank-tuple order (ties pick other nodes)"),
    ("tree.py", "walk = [torch.arange(N, device=dev).expand_as(parents)]   # [..., N] each node, then a step up",
     "walk = [torch.where(parents >= 0, parents, torch.arange(N, device=dev))]",
     "masks: a tree node does not see itself, only its ancestors"),
    ("model.py", "visible = (j < 0)[:, None, :] | (((j >= 0) & (j < T))[:, None, :] & in_tree)",
     "visible = (j < 0)[:, None, :] | (((j >= 0) & (j < T))[:, None, :])",
     "masks: tree nodes see their siblings and cousins, not only their ancestors"),
    ("generate.py", "logits, taps = m(tree.tokens, start_pos=s.start, positions=s.start[:, None] + tree.depths,",
     "logits, taps = m(tree.tokens, start_pos=s.start, positions=s.start[:, None] + tree.depths + 1,",
     "positions: tree node i at start + depth + 1"),
    ("verify.py", "kv.scatter_(2, slots(start + j), kv.gather(2, slots(src)))  # gathered first: no aliasing",
     "kv.scatter_(2, slots(start + j), kv.gather(2, slots(start + j)))  # gathered first: no aliasing",
     "KV commit: the accepted path's KV is not moved into place"),
    ("generate.py", "n = path_len * s.active                   # [B] tokens committed (finished rows: 0)",
     "n = path_len                   # [B] tokens committed (finished rows: 0)",
     "batch rows: finished rows keep advancing their cache position"),
    ("generate.py", "hidden_layers=self.taps, cache_row=b, debug=debug)",
     "hidden_layers=self.taps, cache_row=0, debug=debug)",
     "batch rows: every prompt prefills into cache row 0"),
    ("verify.py", "logits = logits.masked_fill(logits < kth, float(\"-inf\"))",
     "logits = logits.masked_fill(logits <= kth, float(\"-inf\"))",
     "sampling: top-k keeps k - 1 tokens"),
    ("verify.py", "drop = p.cumsum(-1) - p >= top_p  # keep the smallest prefix reaching top_p",
     "drop = p.cumsum(-1) >= top_p  # keep the smallest prefix reaching top_p",
     "sampling: top-p drops the token that reaches top_p"),
    ("verify.py", "tok = (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax(dim=-1)",
     "tok = (probs * torch.empty_like(probs).exponential_(1, generator=generator)).argmax(dim=-1)",
     "sampling: samples no longer follow the target's distribution"),
    ("generate.py", "if t in self.stop or len(out) >= self.max_new_tokens:",
     "if len(out) >= self.max_new_tokens:",
     "stop tokens: a stop token does not end its row"),
    ("generate.py", "if t in self.stop or len(out) >= self.max_new_tokens:",
     "if t in self.stop or len(out) > self.max_new_tokens:",
     "stop tokens: one token more than max_new_tokens"),
    ("generate.py", "if r < 1 and not self.done[b]:",
     "if r < 0 and not self.done[b]:",
     "cache room: a row decodes one token past the cache end"),
    ("generate.py", "tree = tree and all(d or r >= width for d, r in zip(self.done, room))",
     "tree = tree and all(d or r + 1 >= width for d, r in zip(self.done, room))",
     "cache room: a tree allowed one slot past the cache end"),
    ("generate.py", "k = min(self.width, d.block_size)",
     "k = min(self.width, d.block_size) - 1",
     "drafter context: the last accepted node's hidden state never reaches the drafter"),
    ("draft.py", "f = self.fuse(ctx_feats)                                                     # [B, n, D]",
     "f = self.fuse(ctx_feats.flip(1))                                                     # [B, n, D]",
     "drafter context: the context rows fed in the wrong order (lossless; acceptance falls)"),
    ("draft.py", "ctx_slots = ctx_len[:, None] + ids[:n] + bs * (ids[:n] >= n_valid[:, None])  # [B, n]",
     "ctx_slots = ctx_len[:, None] + ids[:n] + 1 + bs * (ids[:n] >= n_valid[:, None])  # [B, n]",
     "drafter context: the context rows one position late (lossless; acceptance falls)"),
    ("generate.py", "tree = (ddtree.chain_tree_batched(draft_logits, s.root, d.block_size - 1) if self.chain",
     "tree = (ddtree.chain_tree_batched(draft_logits, s.root, d.block_size - 2) if self.chain",
     "chain: the chain one node short"),
    ("tree.py", "dev, n = draft_logits.device, min(length, L)",
     "dev, n = draft_logits.device, min(length, L - 1)",
     "chain: the chain one node short of the drafter's block"),
    ("autobudget.py", "rows = (s.start - p0 - s.new_ctx_len)[:, None] + torch.arange(bs, device=p0.device)",
     "rows = (s.start - p0 - s.new_ctx_len - 1)[:, None] + torch.arange(bs, device=p0.device)",
     "auto catch-up: the missed tokens' context rows off by one"),
    ("autobudget.py", "window = [(s[max(len(s) - 1 - bs, 0):-1] + [0] * bs)[:bs] for s in seqs]",
     "window = [(s[max(len(s) - bs, 0):] + [0] * bs)[:bs] for s in seqs]",
     "auto catch-up: the window holds the bonus, one position late"),
]


def tracked_files() -> list[str]:
    """The repository's files as the working tree has them: tracked, and new ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and os.path.isfile(os.path.join(ROOT, f))]


def line_of(root: str, file: str, old: str) -> tuple[list[str], int]:
    """`file`'s lines and the index of the one that reads `old` (stripped); a mutant that no longer
    matches exactly one line is stale, an error."""
    lines = open(os.path.join(root, file), encoding="utf-8").read().split("\n")
    hits = [i for i, line in enumerate(lines) if line.strip() == old]
    if len(hits) != 1:
        raise SystemExit(f"error: {file}: {len(hits)} lines read {old!r}, expected one (the mutant is stale)")
    return lines, hits[0]


def apply(root: str, file: str, old: str, new: str) -> None:
    """The one line of `file` that reads `old` becomes `new`, indentation kept."""
    lines, i = line_of(root, file, old)
    lines[i] = lines[i][:len(lines[i]) - len(lines[i].lstrip())] + new
    path = os.path.join(root, file)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def run_mutant(files: list[str], mutant: tuple, timeout: float) -> tuple[bool, float, str]:
    """(caught, seconds, the last line of the quick check's output) for one mutant in a fresh copy."""
    file, old, new, _ = mutant
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        for f in files:
            os.makedirs(os.path.dirname(os.path.join(tmp, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(tmp, f))
        apply(tmp, file, old, new)
        t = time.time()
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "quick", "-x", "-p", "no:cacheprovider"],
                               cwd=tmp, capture_output=True, text=True, timeout=timeout,
                               env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
            caught, last = r.returncode != 0, (r.stdout.strip().splitlines() or [""])[-1]
        except subprocess.TimeoutExpired:
            caught, last = True, f"timed out after {timeout:.0f} s (a hang counts as caught)"
    return caught, time.time() - t, last


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", default="", help="only the mutants whose file or invariant holds this text")
    p.add_argument("--timeout", type=float, default=300, help="seconds per quick check")
    a = p.parse_args(argv)
    files = tracked_files()
    chosen = [m for m in MUTANTS if a.k in m[0] or a.k in m[3]]
    for file, old, _, _ in chosen:        # every mutant still applies, before any runs
        line_of(ROOT, file, old)
    survived = []
    for i, m in enumerate(chosen, 1):
        caught, secs, last = run_mutant(files, m, a.timeout)
        print(f"[{i}/{len(chosen)}] {'caught  ' if caught else 'SURVIVED'} {secs:5.0f} s  {m[0]}: {m[3]}  ({last})",
              flush=True)
        if not caught:
            survived.append(m)
    print(f"\n{len(chosen) - len(survived)} / {len(chosen)} caught")
    for file, old, new, what in survived:
        print(f"survived: {file}: {what}\n    {old}\n -> {new}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
