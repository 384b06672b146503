"""trace_page.py: a DDTree run as one self-contained HTML page: each step's draft tree, what the target said at every
node, and what the step kept.

    python generate.py --raw --prompt "def fib(n):" --max-new-tokens 40 --trace step.html    # then open step.html
    python -m pytest -q tests/test_trace.py

A step as the page draws it: the tree grows left to right from its root, the last committed token. Each node
shows its token, the drafter's q (its probability of that token after the parent) and the path's log Q, and
under them the target's own token after the node with its probability (softmax(logits / T); greedy: the argmax,
with its probability at T = 1). The walk starts at the root and moves to the child holding the target's token;
it stops at the first node with no such child, and the target's token there is the bonus. The accepted path
and the bonus are drawn on the top row: it reads as the text the step committed.

Invariant: the page shows the step's own tensors (generate.View), read after the step, never inside it, so a
traced run decodes exactly like an untraced one; without --trace no callback is installed and nothing is read.
The page is plain HTML: inline SVG, a little CSS, a little JavaScript to move between steps; nothing is fetched.
Every step's tree is on the page, closed but the first: a few KB per step at budget 8.
"""
from __future__ import annotations

import html
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

import files

W, H, COL, ROW = 152, 50, 184, 58        # a node's box; the column and row pitch of a drawn tree (px)
TAIL = 240                               # characters of committed text shown before a step's new tokens
SHOWN = ("ckpt", "draft", "budget", "chain", "temperature", "top_k", "top_p", "seed", "max_new_tokens", "dtype",
         "device", "cuda_graph", "compile", "no_triton")     # the settings the header lists, when set


@dataclass
class StepRecord:
    """One row of one step, on the host: the tree's valid nodes (padding, always the tail, is dropped)."""
    tokens: list[int]        # [n] node tokens, the root first
    parents: list[int]       # [n] parent node, -1 for the root
    scores: list[float]      # [n] the drafter's log Q of the path root..i
    targets: list[int]       # [n] the target's token after each node (argmax, or its sample)
    p_target: list[float]    # [n] its probability: softmax(logits / T), T = 1 when greedy
    p_token: list[float]     # [n] the target's probability of the node's own token after the parent
    path: list[int]          # the accepted nodes, root first (path_len of them)
    new: list[int]           # the tokens the step committed: the path's after the root, then the bonus


@dataclass
class Section:
    """One prompt of one run (a chat turn, a line of --prompts): its steps, and the run's generate.Stats."""
    prompt: list[int]
    stats: object = None
    steps: list[StepRecord] = field(default_factory=list)


def read_step(view, b: int, new_tokens: list[int], temperature: float) -> StepRecord:
    """Row b of a step's View -> a StepRecord, with one device-to-host copy. The logits are read at two tokens
    per node: the target's own (p_target) and the node's token after its parent (p_token)."""
    t, N = view.tree, view.tree.tokens.shape[-1]
    z = view.logits[b].float() / (temperature or 1.0)                                             # [N, V]
    lse = z.logsumexp(-1)                                                                         # [N]
    parent = t.parents[b].clamp(min=0)                                                           # [N]
    p_target = (z.gather(1, view.targets[b, :, None])[:, 0] - lse).exp()                        # [N]
    p_token = (z[parent, t.tokens[b]] - lse[parent]).exp()                                       # [N]
    rows = torch.stack([x.double() for x in (t.tokens[b], t.parents[b], t.scores[b], t.valid[b], view.targets[b],
                                              p_target, p_token, view.accepted[b], view.path_len[b].expand(N))])
    tok, par, score, valid, tgt, pt, pk, acc, k = rows.tolist()                                  # [9, N]
    n, k = int(sum(valid)), int(k[0])
    ints = lambda xs, m=n: [int(x) for x in xs[:m]]
    return StepRecord(ints(tok), ints(par), score[:n], ints(tgt), pt[:n], pk[:n], ints(acc, k), list(new_tokens))


class Trace:
    """Collects each speculative step (on_step, generate's callback) into sections and writes the page.

        trace = Trace(tokenizer.decode, vars(args))    # settings: the run's flags, shown in the header
        trace.begin([prompt_ids], stats)               # a new run, one section per prompt
        generate(..., on_step=trace.on_step, stats=stats)
        trace.write("step.html")                       # every run so far (chat: call it after each turn)
    """

    def __init__(self, decode: Callable[[list[int]], str], settings: dict, then=None):
        self.decode, self.settings = decode, settings
        self.then = then                   # another on_step (--show-tree's printer) that sees each step first
        self.temperature = float(settings.get("temperature") or 0.0)
        self.runs: list[list[Section]] = []
        self._text: dict[int, str] = {}

    def begin(self, prompts: list[list[int]], stats=None) -> None:
        """A new run: one section per prompt (row b of the batch). stats: its generate.Stats (stage times)."""
        self.runs.append([Section(list(p), stats) for p in prompts])

    def on_step(self, b: int, view, new_tokens: list[int]) -> None:
        if self.then is not None:
            self.then(b, view, new_tokens)
        if not self.runs:
            self.begin([])
        while len(self.runs[-1]) <= b:     # steps of a row that begin() did not announce
            self.runs[-1].append(Section([]))
        self.runs[-1][b].steps.append(read_step(view, b, new_tokens, self.temperature))

    def write(self, path: str) -> None:
        """The page, replacing the file at path whole (a failed write leaves the previous page)."""
        files.write_text(path, self.page())

    # ---- the page: a header, then per section its prompt, text and steps ----

    def page(self) -> str:
        steps = [st for run in self.runs for s in run for st in s.steps]
        lens = [len(st.path) for st in steps]
        first = self.runs[0][0].prompt if self.runs and self.runs[0] else []
        parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>DDTree trace: "
                 f"{esc(_short(self.decode(first)[-50:], 50))}</title><style>{CSS}</style></head><body>"
                 f"<header><div><h1>DDTree trace</h1>{self.settings_line()}<p>{len(steps)} steps, {sum(lens)} "
                 f"tokens committed; mean accept length <b>{_mean(lens):.2f}</b> (tokens per step: the accepted "
                 f"drafts + the bonus)</p>{LEGEND}</div>{histogram(lens)}</header>", NAV]
        g = 0                              # steps are numbered across the page: element ids s0, s1, ...
        for r, run in enumerate(self.runs):
            for b, s in enumerate(run):
                name = ", ".join(([f"prompt {b + 1} of {len(run)}"] if len(run) > 1 else [])
                                 + ([f"turn {r + 1}"] if len(self.runs) > 1 else []))
                parts.append(self.section(s, name, g))
                g += len(s.steps)
        parts.append(f"<script>{JS}</script></body></html>")
        return "\n".join(parts)

    def settings_line(self) -> str:
        shown = sorted(((k, os.path.basename(os.path.normpath(v)) if k in ("ckpt", "draft") else v)
                        for k, v in self.settings.items() if k in SHOWN and v is not None and v is not False),
                       key=lambda kv: SHOWN.index(kv[0]))
        return "<p class=set>" + " · ".join(f"{k.replace('_', '-')} <b>{esc(str(v))}</b>" if v is not True else
                                            f"<b>{k.replace('_', '-')}</b>" for k, v in shown) + "</p>"

    def section(self, s: Section, name: str, g0: int) -> str:
        """A prompt: its text, its accept lengths and committed text (both link to the steps), then its steps."""
        ids = [s.steps[0].tokens[0]] if s.steps else []       # the first root: the token the prefill committed
        texts = [self.decode(ids)]                             # texts[k]: the committed text before step k
        for st in s.steps:
            ids += st.new
            texts.append(self.decode(ids))
        lens, prompt = [len(st.path) for st in s.steps], self.decode(s.prompt)
        times = getattr(s.stats, "step_s", None) or []         # per step {stage: seconds}, when timed
        out = ["<section>" + (f"<h2>{esc(name)}: {len(s.steps)} steps, mean accept length {_mean(lens):.2f}</h2>"
                              if name else ""),
               f"<details class=prompt><summary>prompt: {len(s.prompt)} tokens, ending <code>"
               f"{esc(_short(prompt[-60:], 60))}</code></summary><pre>{esc(prompt)}</pre></details>",
               "<p class=note>accept length per step (a bar links to its step), then the committed text (a step's "
               "tokens link to it):</p>", strip(lens, g0),
               "<p class=text>" + esc(texts[0]) + "".join(f"<a href=#s{g0 + k} class=c{k % 2}>"
                                                          f"{esc(_new_part(texts[k], texts[k + 1]))}</a>"
                                                          for k in range(len(s.steps))) + "</p>"]
        for k, st in enumerate(s.steps):
            out.append(self.step(st, g0 + k, k, texts[k], texts[k + 1], times[k] if k < len(times) else None))
        return "\n".join(out) + "</section>"

    def step(self, st: StepRecord, g: int, k: int, before: str, after: str, times: dict | None) -> str:
        """One step, collapsible: a summary line, the committed text with the new tokens marked, the tree, the
        walk in words. Only the page's first step starts open."""
        new = _new_part(before, after)
        old = after[:len(after) - len(new)]
        when = ""
        if times:                # eager: each stage; compiled or captured: one lap for the whole step
            when = " · " + (" ".join(f"{s} {1000 * v:.1f}" for s, v in times.items()) + " ms" if len(times) > 1
                            else f"step {1000 * sum(times.values()):.1f} ms")
        return (f"<details class=step id=s{g}{' open' if g == 0 else ''}><summary><b>step {k + 1}</b> · accept "
                f"{len(st.path)} ({len(st.path) - 1} drafted + bonus) · <code>{esc(_short(new, 40))}</code>{when}"
                f"</summary><p class=ctx>{'…' if len(old) > TAIL else ''}{esc(old[-TAIL:])}<mark>{esc(new)}</mark>"
                f"</p>{self.tree_svg(st, g)}{self.walk(st)}</details>")

    def tree_svg(self, st: StepRecord, g: int) -> str:
        """The tree, left to right; the accepted path and the bonus (node n here) on the top row."""
        n, path, stop = len(st.tokens), set(st.path), st.path[-1]
        children = [[] for _ in range(n + 1)]
        for i in range(1, n):
            children[st.parents[i]].append(i)
        children[stop].append(n)                               # the bonus hangs off the node where the walk stopped
        for c in children:
            c.sort(key=lambda i: (i != n and i not in path, i))   # the path's child first, then by the drafter's rank
        depth, row, rows = [0] * (n + 1), [0] * (n + 1), [0]

        def place(i: int) -> None:       # depth first: a leaf takes the next free row, a parent its first child's
            for j, c in enumerate(children[i]):
                depth[c] = depth[i] + 1
                place(c)
                row[i] = row[c] if j == 0 else row[i]
            if not children[i]:
                row[i], rows[0] = rows[0], rows[0] + 1

        place(0)
        xy = [(6 + COL * depth[i], 6 + ROW * row[i]) for i in range(n + 1)]
        width, height = 12 + COL * max(depth) + W, 12 + ROW * (rows[0] - 1) + H
        parts = [f"<svg class=tree data-step={g} data-nodes={n} width={width} height={height}>"]
        for i in range(1, n + 1):        # the edges first, under the boxes
            (x0, y0), (x1, y1) = xy[st.parents[i] if i < n else stop], xy[i]
            x0, y0, y1, xm = x0 + W, y0 + H // 2, y1 + H // 2, (x0 + W + x1) // 2
            kind = "b" if i == n else "a" if i in path else "r"
            parts.append(f"<path class=e{kind} d='M{x0} {y0}C{xm} {y0} {xm} {y1} {x1} {y1}'/>")
        parts += [self.node_svg(st, i, xy[i], i in path, i == stop) for i in range(n)]
        t, (x, y) = st.targets[stop], xy[n]
        parts.append(f"<g class=bonus data-tok={t} transform='translate({x},{y})'><title>bonus {esc(repr(self.tok(t)))}"
                     f" id {t}: the target's token after node {stop}, which has no child holding it</title><rect/>"
                     f"<text x=8 y=17 class=t>{esc(_show(self.tok(t)))}</text><text x=8 y=31>bonus: the target's"
                     f" token</text><text x=8 y=44>after node {stop}, p {_p(st.p_target[stop])}</text></g></svg>")
        return "".join(parts)

    def node_svg(self, st: StepRecord, i: int, xy: tuple[int, int], accepted: bool, stop: bool) -> str:
        """A node's box: token and number; the drafter's q and log Q; the target's token after it, and its p.
        Hovering shows the numbers in full and the target's probability of this node's own token."""
        t = st.tokens[i]
        tip = f"node {i} {self.tok(t)!r} id {t}" + (
            f": drafter q {_q(st, i):.4f}, log Q {st.scores[i]:.3f}; target p {st.p_token[i]:.4f}" if i else "")
        drafter = f"q {_p(_q(st, i))} · log Q {st.scores[i]:.2f}" if i else "root: last committed"
        return (f"<g class='n{' acc' if accepted else ''}{' stop' if stop else ''}' data-i={i} data-tok={t} "
                f"transform='translate({xy[0]},{xy[1]})'><title>{esc(tip)}</title><rect/><text x=8 y=17 class=t>"
                f"{esc(_show(self.tok(t)))}</text><text x={W - 6} y=14 class=i>{i}</text><text x=8 y=31>{drafter}"
                f"</text><text x=8 y=44 class=v>→ {esc(_show(self.tok(st.targets[i]), 9))} {_p(st.p_target[i])}"
                f"</text></g>")

    def walk(self, st: StepRecord) -> str:
        """The walk in words: the path it took, and why it stopped where it did."""
        path = " → ".join(f"{i} <code>{esc(_show(self.tok(st.tokens[i])))}</code>" for i in st.path)
        stop, bonus = st.path[-1], esc(_show(self.tok(st.targets[st.path[-1]])))
        return (f"<p class=why>The walk: node {path}. Node {stop} has no child <code>{bonus}</code>, the target's "
                f"token after it: the walk stops there, and <code>{bonus}</code> is the bonus.</p>")

    def tok(self, t: int) -> str:
        """One token's text, cached (a page shows a token many times)."""
        if t not in self._text:
            self._text[t] = self.decode([t])
        return self._text[t]


# ---- small pieces ----

def esc(s: str) -> str:
    """Text for the page, with every <, > and & escaped (the page's attribute values are numbers and names)."""
    return html.escape(s, quote=False)


def _show(s: str, width: int = 16) -> str:
    """A token's text made visible: spaces, newlines and tabs as symbols, cut to `width` characters."""
    s = s.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") or "∅"
    return s if len(s) <= width else s[:width - 1] + "…"


def _short(s: str, width: int) -> str:
    s = s.replace("\n", "⏎")
    return s if len(s) <= width else s[:width - 1] + "…"


def _q(st: StepRecord, i: int) -> float:
    """The drafter's probability of node i's token after its parent: exp(score - the parent's score)."""
    return math.exp(st.scores[i] - st.scores[st.parents[i]]) if i else 1.0


def _p(p: float) -> str:
    return f"{p:.2f}" if p >= 0.01 else f"{p:.0e}"


def _mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _new_part(before: str, after: str) -> str:
    """The text a step added. Usually after = before + new; when the step completed a UTF-8 character that
    `before` ended with as U+FFFD, the new part starts where the two texts first differ."""
    if after.startswith(before):
        return after[len(before):]
    n = 0
    while n < min(len(before), len(after)) and before[n] == after[n]:
        n += 1
    return after[n:]


def histogram(lens: list[int]) -> str:
    """Steps per accept length: one bar per length, its count on top."""
    if not lens:
        return ""
    count, top, bw = Counter(lens), max(lens), 34
    bars = []
    for a in range(1, top + 1):
        h, x = round(60 * count[a] / max(count.values())), 4 + (a - 1) * bw
        bars.append(f"<rect x={x} y={76 - h} width={bw - 6} height={h} /><text x={x + bw // 2 - 3} y={72 - h}>"
                    f"{count[a]}</text><text x={x + bw // 2 - 3} y=90>{a}</text>")
    return (f"<figure class=hist><svg width={8 + top * bw} height=94>{''.join(bars)}</svg><figcaption>steps per "
            f"accept length</figcaption></figure>")


def strip(lens: list[int], g0: int) -> str:
    """The accept length of each step, one bar each, linking to the step."""
    top = max(lens, default=1)
    bars = "".join(f"<a href=#s{g0 + k}><rect x={k} y={top - a} width=.86 height={a}><title>step {k + 1}: accept "
                   f"{a}</title></rect></a>" for k, a in enumerate(lens))
    return f"<svg class=strip viewBox='0 0 {max(len(lens), 1)} {top}' preserveAspectRatio=none>{bars}</svg>"


LEGEND = """<details class=legend open><summary>How to read a step</summary><ul>
<li>The drafter proposed a <b>tree</b> of continuations in one pass; it grows left to right from the <b>root</b>, the
last committed token. A box is a node: its token (<code>␣</code> a space, <code>⏎</code> a newline), its number (the
drafter's rank), the drafter's <b>q</b> (its probability of that token after the parent) and <b>log Q</b> (the sum of
log q along the path, which ranks the nodes).</li>
<li>The last line, <b>→ token p</b>, is the <b>target</b>'s: the token it puts after that node and its probability
(greedy: the argmax, p at temperature 1; sampling: its sample, p at the run's temperature, before top-k/top-p). One
target forward saw every node.</li>
<li>The walk starts at the root and moves to the child holding the target's token; it <b>stops</b> at the first node
with no such child. <span class=k1>Green</span>: the accepted path; <span class=k2>orange</span>: where the walk
stopped, and the <b>bonus</b>, the target's token there. The step commits the path's tokens and the bonus: the top
row.</li>
<li>Keys: <kbd>→</kbd> or <kbd>j</kbd> next step, <kbd>←</kbd> or <kbd>k</kbd> previous; hover a box for its numbers
in full and the target's probability p of the node's own token.</li></ul></details>"""

NAV = ("<nav><button id=prev>◀ prev</button> <span id=pos>step</span> <button id=next>next ▶</button> "
       "<button id=all>open all</button> <button id=none>close all</button></nav>")

CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:0 18px 40px;color:#222}
header{display:flex;gap:24px;align-items:flex-end}h1{font-size:20px;margin:10px 0 4px}
h2{font-size:17px;margin:18px 0 4px;border-top:1px solid #ccc;padding-top:8px}header p{margin:4px 0}.set{color:#444}
code,pre,.text,.ctx{font-family:ui-monospace,Menlo,Consolas,monospace}
pre,.text,.ctx{white-space:pre-wrap;background:#f6f6f4;padding:6px 8px;border-radius:4px;margin:4px 0}
.text{max-height:9em;overflow:auto}.text a{color:inherit;text-decoration:none}.text .c0{background:#e4ecf7}
.text .c1{background:#f3e6d0}mark{background:#ffd58a}.legend{margin:6px 0;font-size:13px}.legend ul{margin:4px 0}
.k1{background:#cdeccd;padding:0 3px}.k2{background:#ffd9a8;padding:0 3px}
nav{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #ddd;z-index:1}
details.step{margin:6px 0;scroll-margin-top:44px}details.step>summary{cursor:pointer;padding:2px 4px}
details.step.cur>summary{background:#eef3fb}.tree{display:block;margin:4px 0 6px}
.tree text{font-size:10.5px;fill:#555}.tree .t{font:600 13px ui-monospace,Menlo,Consolas,monospace;fill:#111}
.tree .i{text-anchor:end;font-size:9px;fill:#999}.tree .v{fill:#7a2a8c}
.tree rect{width:Wpx;height:Hpx;rx:6px}.n rect{fill:#fff;stroke:#aaa}
.n.acc rect{fill:#dff3df;stroke:#2e8b3e;stroke-width:2}
.n.stop rect{stroke:#e07b00;stroke-width:3}.bonus rect{fill:#ffe3bd;stroke:#e07b00;stroke-width:2;stroke-dasharray:5 3}
path{fill:none}.er{stroke:#bbb;stroke-width:1.2}.ea{stroke:#2e8b3e;stroke-width:3}
.eb{stroke:#e07b00;stroke-width:2.5;stroke-dasharray:5 3}.why{margin:0 0 10px;font-size:13px;color:#444}
.why code{background:#eee;padding:0 3px}.hist{margin:4px 0;flex:none}.hist rect{fill:#6b8fc7}
.hist text{font-size:11px;text-anchor:middle}.hist figcaption{font-size:12px;color:#555}
.note{margin:8px 0 2px;font-size:12px;color:#555}.strip{width:100%;height:28px;display:block;background:#fafafa}
.strip rect{fill:#6b8fc7}.strip a:hover rect{fill:#e07b00}""".replace("Wpx", f"{W}px").replace("Hpx", f"{H}px")

JS = """const S=[...document.querySelectorAll('details.step')],pos=document.getElementById('pos');let cur=0;
function mark(i){S[cur].classList.remove('cur');cur=i;S[i].classList.add('cur');
pos.textContent='step '+(i+1)+' / '+S.length;}
function go(i){if(!S.length)return;i=Math.max(0,Math.min(S.length-1,i));if(i!==cur)S[cur].open=false;mark(i);
S[i].open=true;S[i].scrollIntoView({block:'start'});}
document.getElementById('prev').onclick=()=>go(cur-1);document.getElementById('next').onclick=()=>go(cur+1);
document.getElementById('all').onclick=()=>S.forEach(s=>s.open=true);
document.getElementById('none').onclick=()=>S.forEach(s=>s.open=false);
document.addEventListener('keydown',e=>{if(e.key==='ArrowRight'||e.key==='j')go(cur+1);
else if(e.key==='ArrowLeft'||e.key==='k')go(cur-1);});
document.addEventListener('click',e=>{const a=e.target.closest('a[href^="#s"]');if(a){e.preventDefault();
go(S.indexOf(document.getElementById(a.getAttribute('href').slice(1))));}
const m=e.target.closest('details.step>summary');if(m)mark(S.indexOf(m.parentElement));});
if(S.length){const h=location.hash?S.indexOf(document.getElementById(location.hash.slice(1))):-1;
if(h>0)go(h);else mark(0);}"""
