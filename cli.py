"""The command line of generate.py: flags and their checks, loading, streaming, chat. The decoding itself (Step,
generate_batch) is generate.py; this file turns flags into its arguments and its tokens into text.

    python generate.py --help                            # every flag (generate.py runs cli.main)
    python generate.py                                   # a terminal on stdin: chat through the chat template
    torchrun --nproc-per-node 8 generate.py --ckpt random:k2.6 --prompt-ids 1,2,3 --cuda-graph   # no download

Invariant: a user mistake (bad flag, path, config, prompt) is one line naming the flag or file, exit code 2, no
traceback (--debug shows it), and it is caught before the weights load wherever it can be. Ctrl-C is one line,
exit code 130, after what was generated so far. Every case: docs/FAULTS.md.
Tests: python -m pytest -q tests/test_cli.py tests/test_faults.py
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import stat
import sys

import torch

import checkpoint as C
import files
import generate as G
import kernels
import model as M
import tree as ddtree
import verify

MAX_BUDGET = 1024      # verify width B+1; above 64 rows the tree attention runs its PyTorch reference


def check_args(a: argparse.Namespace) -> None:
    """Every flag against its range, the other flags and the file system, before anything loads (ValueError naming
    the flag). Parses --prompt-ids into a list and reads --prompts into a.prompt_texts."""
    if a.ckpt == G.BUNDLED_TARGET and a.draft is None:
        a.draft = G.BUNDLED_DRAFT
    if C.is_random(a.ckpt):      # random weights: the random drafter of the same shapes; ids in, ids out
        a.draft = a.ckpt + "-dflash" if a.draft is None else a.draft
        if a.tokenizer is None and a.prompt_ids is None:
            raise ValueError(f"--ckpt {a.ckpt} has no tokenizer: give the prompt as --prompt-ids (or pass --tokenizer)")
    check_ranges([("--budget", a.budget == "auto" or 0 <= a.budget <= MAX_BUDGET,
                   f"in [0, {MAX_BUDGET}] or auto", a.budget),
                  ("--max-new-tokens", a.max_new_tokens >= 1, ">= 1", a.max_new_tokens),
                  ("--max-seq-len", a.max_seq_len >= 2, ">= 2", a.max_seq_len),
                  ("--temperature", verify.temperature_ok(a.temperature), verify.TEMPERATURE_RULE,
                   a.temperature),
                  ("--top-k", a.top_k >= 0, ">= 0 (0: off)", a.top_k),
                  ("--top-p", 0 < a.top_p <= 1, "in (0, 1]", a.top_p),
                  ("--seed", 0 <= a.seed < 2**63, "in [0, 2^63)", a.seed)])
    for flag, path in (("--ckpt", a.ckpt), ("--draft", a.draft), ("--tokenizer", a.tokenizer)):
        if C.is_random(path) and flag != "--tokenizer":
            C.random_config(path)           # an unknown name: one line listing the random models there are
        elif path is not None and not os.path.isdir(path):
            raise ValueError(f"{flag} {path}: no such checkpoint directory")
    if a.device:
        check_device(a.device)
    if a.prompt_ids is not None:
        from tokenizer import is_id
        ids = [t.strip() for t in a.prompt_ids.split(",")]
        if not all(map(is_id, ids)):       # as the tokenizer files spell ids: not '1_0' (token 10 to int()), '+1'
            raise ValueError(f"--prompt-ids {a.prompt_ids!r}: expected comma-separated token ids, e.g. 1,2,3")
        a.prompt_ids = [int(t) for t in ids]
    a.prompt_texts = None
    if a.prompts is not None:
        text = read_text("--prompts", a.prompts, "a text file with one prompt per line")
        a.prompt_texts = [line for line in universal_newlines(text).split("\n") if line.strip()]
        if not a.prompt_texts:
            raise ValueError(f"--prompts {a.prompts}: no prompts (one per line)")
    for flag, on in (("--chain", a.chain), ("--trace", a.trace)):
        if on and a.budget == "auto":
            raise ValueError(f"{flag} with --budget auto: auto chooses between a tree and one token per step, and "
                             f"{flag} needs every step drafted; give a fixed --budget")
    for flag, on in (("--chain", a.chain), ("--show-tree", a.show_tree), ("--trace", a.trace)):
        if on and not (a.draft and a.budget != 0):     # nothing would be drafted: decoding is autoregressive
            raise ValueError(f"{flag} needs a drafter (--draft) and --budget >= 1, got "
                             + ("--budget 0" if a.draft else "no --draft"))
    if a.cuda_graph and (a.device == "cpu" or not torch.cuda.is_available()):
        raise ValueError("--cuda-graph needs a CUDA device")
    if a.trace is not None:
        check_output_path("--trace", a.trace, inputs=(a.prompts, a.ckpt, a.draft, a.tokenizer))
    if a.show_tree and a.prompts:
        raise ValueError("--show-tree prints one sequence's trees: not with --prompts")
    if (a.raw or a.prompt_ids is not None) and (a.system is not None or a.thinking is not None):
        raise ValueError("--system and --thinking/--no-thinking shape the chat template: not with --raw, --prompt-ids")


def check_ranges(rows) -> None:
    """rows of (flag, whether its value is good, what it must be, the value): the first bad one is a ValueError
    `<flag> must be <what>, got <value>`."""
    for flag, ok, want, got in rows:
        if not ok:
            raise ValueError(f"{flag} must be {want}, got {got}")


def check_device(device: str) -> None:
    """--device: cpu, cuda or cuda:N, and a CUDA device this torch can see (a ValueError naming the flag)."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):       # meta, mps, xpu...: this engine runs on CUDA GPUs or the CPU
        raise ValueError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if kind == "cuda" and (torch.device(device).index or 0) >= torch.cuda.device_count():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no such CUDA device is visible"
        raise ValueError(f"--device {device}: {why} (torch {torch.__version__}); use --device cpu")


def exit_code(run) -> int:
    """run() under the project's rule for a script's end (bench.py, train.py): a user mistake or a file that
    cannot be read or written is one line `error: ...` and exit code 2; Ctrl-C is one line and 130."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run()
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        return 130
    return 0


def read_text(flag: str, path: str, want: str, limit: int = 1 << 30) -> str:
    """A text file (or a pipe: `--prompts <(...)`) named by a flag, as UTF-8 text; a directory, a device, a
    binary file or one over `limit` bytes is an error naming the flag and the file."""
    try:
        kind = os.stat(path).st_mode
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror.lower()}: expected {want}") from None
    if not (stat.S_ISREG(kind) or stat.S_ISFIFO(kind)):
        what = "a directory" if stat.S_ISDIR(kind) else "a device" if stat.S_ISCHR(kind) or stat.S_ISBLK(kind) \
            else "not a regular file"
        raise ValueError(f"{flag} {path} is {what}: expected {want}")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror.lower()}") from None
    if len(data) > limit:
        raise ValueError(f"{flag} {path}: more than {limit >> 20} MiB: expected {want}")
    return decode_text(flag + " " + path, data, want)


def decode_text(where: str, data: bytes, want: str) -> str:
    """UTF-8 bytes -> text (a leading BOM dropped); binary data (not UTF-8, or NUL bytes) is an error naming
    `where` and the line."""
    data = data.removeprefix(b"\xef\xbb\xbf")     # a leading byte-order mark is no part of the text
    bad = data.find(b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = e.start if bad < 0 else min(bad, e.start)
    if bad >= 0:
        line = data.count(b"\n", 0, bad) + 1
        raise ValueError(f"{where}: line {line} is not UTF-8 text (byte {data[bad]:#04x} at offset {bad}): "
                         f"expected {want}")
    return text


def universal_newlines(text: str) -> str:
    """\r\n and \r as \n, as Python's text files read them."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def check_output_path(flag: str, path: str, inputs=()) -> None:
    """Before any work: `path` can be written (its directory exists, it is not a directory, a FIFO or a device,
    it may be created or overwritten) and is none of the files the run reads (`inputs`: files, or directories
    standing for their files). The probe creates the file and removes it again if it was not there."""
    if not path:
        raise ValueError(f"{flag} {path!r}: expected a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory: expected a file to write")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: no such directory to write the file in ({parent})")
    try:
        existed = files.regular_file(path)      # a FIFO would block the probe's open until a reader came
    except ValueError as e:
        raise ValueError(f"{flag} {e}: expected a file to write") from None
    files.check_not_input(flag, path, inputs)
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror.lower()})") from None
    if not existed:
        try:
            os.remove(path)
        except FileNotFoundError:   # under torchrun every rank probes: another removed it first
            pass


def check_cache_memory(a, margs: M.ModelArgs, dargs, device: torch.device, dtype: torch.dtype, batch: int) -> None:
    """--max-seq-len sizes the KV caches up front: refuse one that cannot fit, before the weights load."""
    import draft as dflash
    target = math.prod(M.Transformer.cache_shape(margs, batch, a.max_seq_len)) * dtype.itemsize
    drafter = math.prod(dflash.DFlashDrafter.cache_shape(dargs, batch, a.max_seq_len, dargs.num_key_value_heads
                                                    // M.world_size)) * dtype.itemsize if dargs else 0
    need = target + drafter
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:      # Linux's MemAvailable (it counts the page cache the kernel would give back); elsewhere unknown
        meminfo = open("/proc/meminfo").read().splitlines() if os.path.exists("/proc/meminfo") else []
        free = next((int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")), float("inf"))
    if need > free:
        of = ", ".join([f"target {target / 2**30:.1f} GiB"] + [f"drafter {drafter / 2**30:.1f} GiB"] * bool(dargs)
                       + [f"{batch} prompts"] * (batch > 1))
        raise ValueError(f"--max-seq-len {a.max_seq_len}: the KV caches need {need / 2**30:.1f} GiB, but {device} "
                         f"has {free / 2**30:.1f} GiB free ({of}); lower --max-seq-len")


# torchrun: this process's rank, its device and the process group

def init_distributed(timeout_s: float = 300.0, device: str | None = None) -> torch.device:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPU) and return this rank's device:
    `device` (a --device flag; "cuda" means this rank's GPU), else this rank's GPU if there is one,
    else the CPU. The backend follows the device, so --device cpu on a GPU host runs over gloo."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    M.set_tp(world_size, int(os.environ.get("RANK", "0")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if world_size > 1 and not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from datetime import timedelta
        # A timeout turns a rank that died into an error on the others instead of a hang.
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=timeout_s))
    return device


def close_distributed() -> None:
    """Leave the process group at exit: every rank waits for the others, then tears down (without
    this, gloo aborts at interpreter exit with 'terminate called without an active exception')."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        if torch.distributed.get_backend() == "gloo":
            # NCCL is left to process exit: destroy_process_group() can hang in a process that
            # captured NCCL all-reduces in a CUDA graph
            torch.distributed.destroy_process_group()


def main(argv=None) -> int:
    """CLI entry: a user mistake (bad flag, path, config, prompt) prints one line on rank 0 and exits 2; --debug
    shows the traceback instead. Ctrl-C prints one line and exits 130, after what was generated so far (and the
    --trace page of the steps so far). Under torchrun the ranks exit 0 after an error's line: torchrun answers a
    worker's non-zero exit with a traceback of its own."""
    a = None
    signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C: KeyboardInterrupt from here on
    try:
        a = build_parser().parse_args(argv)
        rc = _main(a)
    except BrokenPipeError:      # the reader closed stdout (`| head`): stop quietly, as a shell tool does
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nothing left to flush at exit
        except (OSError, ValueError, AttributeError):
            pass
        rc = 141
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        if a is not None and a.debug:
            raise
        if os.environ.get("RANK", "0") == "0":      # M.rank is not set yet when the error comes before init
            print(f"error: {e}", file=sys.stderr)
        rc = 0 if "TORCHELASTIC_RUN_ID" in os.environ else 2
    except KeyboardInterrupt:
        if a is not None and a.debug:
            raise
        if os.environ.get("RANK", "0") == "0":
            print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        rc = 130
    close_distributed()
    return rc


def _main(a: argparse.Namespace) -> int:
    from tokenizer import StreamDecoder, Tokenizer
    from trace_page import Trace
    check_args(a)
    device = init_distributed(device=a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[
        a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if a.no_triton:
        kernels.ENABLED = False
    # everything that can be checked comes before the weights load: configs and tensors, caches, tokenizer, prompts
    margs, dargs = check_models(a, device, dtype)
    tokenizer = (C.IdTokenizer() if C.is_random(a.ckpt) and a.tokenizer is None
                 else Tokenizer.from_dir(a.tokenizer or a.ckpt))
    if tokenizer.vocab_size > margs.vocab_size:
        raise ValueError(f"tokenizer in {a.tokenizer or a.ckpt} has {tokenizer.vocab_size} ids but the model's "
                         f"vocab_size is {margs.vocab_size}")
    chat_kw = {} if a.thinking is None else {"thinking": a.thinking}    # unset: the template's own default
    system = [{"role": "system", "content": a.system}] if a.system is not None else []
    chat_ids = lambda history: tokenizer.apply_chat_template(system + history, **chat_kw)
    encode = tokenizer.encode if a.raw else (lambda text: chat_ids([{"role": "user", "content": text}]))
    prompts, text, chat = read_prompts(a, encode, chat_ids)
    for i, p in enumerate(prompts):
        G.check_prompt(p, margs.vocab_size, a.max_seq_len, f"prompt {i}: " if len(prompts) > 1 else "")

    target = C.load_model(a.ckpt, device, dtype, progress=not a.quiet, check=False)
    drafter = C.load_drafter(a.draft, target.args, device, dtype) if dargs is not None else None
    mem = f"peak host RSS {C.peak_rss_bytes() / 2**30:.2f} GiB" + (
        f", device memory {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else "")
    M.print0(f"[loaded {a.ckpt}" + (f" + drafter {a.draft}" if drafter else "") + f" on {device}, {dtype}; {mem}]")
    modes = [m for m, on in (("graph", a.cuda_graph), ("compile", a.compile)) if on]
    kw = dict(drafter=drafter, budget=a.budget, chain=a.chain, temperature=a.temperature, top_k=a.top_k,
              top_p=a.top_p, seed=a.seed, max_seq_len=a.max_seq_len, stop_ids=tokenizer.stop_ids if not a.raw else (),
              mode="eager" if a.eager or not modes else "+".join(modes), debug=a.debug)   # graph, compile, both
    if a.show_tree:      # each step's tree, then the tokens it committed, never mixed with streamed text
        M.print0(ddtree.LEGEND)
        kw["on_step"] = lambda b, v, new: M.print0("\n" + ddtree.format_tree(
            v.tree[b], lambda t: tokenizer.decode([t]), v.accepted[b, :len(new)], bonus=new[-1]))
    trace = Trace(tokenizer.decode, vars(a), then=kw.get("on_step")) if a.trace and M.rank == 0 else None
    if trace:            # each step's View, read after the step; the page is rewritten after each run (chat turn)
        kw["on_step"] = trace.on_step

    def run(prompt_ids: list[int]) -> list[int]:
        """One prompt, streamed as it is committed (never a broken UTF-8 character), then its statistics.
        Ctrl-C: what was committed is printed, the --trace page written, and the interrupt goes on."""
        dec, stats = StreamDecoder(tokenizer), G.Stats()
        stream = (lambda ids: M.print0("committed: " + " ".join(repr(tokenizer.decode([t])) for t in ids))
                  ) if a.show_tree else (lambda ids: M.print0(dec.push(ids), end="", flush=True))
        if trace:
            trace.begin([prompt_ids], stats)
        try:
            ids = G.generate(target, prompt_ids, a.max_new_tokens, on_tokens=stream, stats=stats, **kw)
        except KeyboardInterrupt:
            M.print0(dec.flush(), flush=True)
            write_trace(trace, a.trace)
            raise
        write_trace(trace, a.trace)
        stop = f", stopped: {stats.stopped}" if stats.stopped else ""
        M.print0(dec.flush() + f"\n[{stats.new_tokens} tokens in {stats.decode_s:.2f} s: {stats.tokens_per_s:.1f} "
                 f"tok/s, prefill {stats.prefill_s * 1000:.0f} ms{stop}]")
        if drafter is not None:
            st = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in stats.stage_s.items())
            mix = f"; steps per budget {stats.budget_mix()} (auto)" if a.budget == "auto" else ""
            M.print0(f"[mean accept length {stats.mean_accept:.2f} over {len(stats.accept_lens)} steps; "
                     f"histogram {stats.histogram()}; {st}{mix}]")
        return ids

    if a.prompt_texts:
        run_batch(a, tokenizer, target, kw, prompts, trace)
    elif chat:
        bundled = os.path.realpath(a.ckpt) == os.path.realpath(G.BUNDLED_TARGET)
        interactive(tokenizer, run, chat_kw, system, note="; the bundled tiny model is a code model, not an "
                    "assistant: it continues code (try --prompt 'def fib(n):' --raw)" if bundled else "",
                    max_seq_len=a.max_seq_len)
    else:
        if text is not None:
            M.print0(text if a.raw else "", end="\n" if a.show_tree else "")   # a raw prompt: the text continues it
        run(prompts[0])
    return 0


def check_models(a, device: torch.device, dtype: torch.dtype) -> tuple:
    """The target's and the drafter's configs, each against its tensors (names and shapes, no data read), against
    each other and this engine, and the memory their KV caches need: before any weight loads.
    Returns (ModelArgs, DraftArgs or None when nothing is drafted)."""
    import draft as dflash
    margs = C.model_args(a.ckpt)
    if not C.is_random(a.ckpt):
        C.check_checkpoint(margs, a.ckpt)
    dargs = C.draft_args(a.draft) if a.draft and a.budget != 0 else None
    if dargs is not None:
        C.check_drafter_compatible(dargs, margs)
        if not C.is_random(a.draft):
            C.check_drafter_layer_count(dargs, a.draft)
        M.check_tp_divisibility(dargs, M.world_size)
        if dargs.block_size > MAX_BUDGET + 1:
            raise ValueError(f"drafter {a.draft}: block_size = {dargs.block_size}, more than this engine drafts "
                             f"and verifies in one step ({MAX_BUDGET + 1})")
    check_cache_memory(a, margs, dargs, device, dtype, len(a.prompt_texts or [0]))
    return margs, dargs


def read_prompts(a, encode, chat_ids) -> tuple[list[list[int]], str | None, bool]:
    """The prompts as token ids, before the weights load (a bad prompt, stdin or chat template is found first):
    (prompts, the prompt's text when it is one text, whether to chat). A chat has no prompt yet: its template is
    rendered once, so that a broken one, or markup the tokenizer lacks, is found now."""
    if a.prompt_texts:
        return [encode(t) for t in a.prompt_texts], None, False
    if a.prompt_ids is not None:
        return [a.prompt_ids], None, False
    if a.prompt is None and sys.stdin.isatty():
        chat_ids([{"role": "user", "content": "hi"}])
        return [], None, True
    raw = getattr(sys.stdin, "buffer", None)                   # bytes, so that binary input gets a clear error
    text = a.prompt if a.prompt is not None else \
        universal_newlines(decode_text("stdin", raw.read(), "a prompt")) if raw else sys.stdin.read()
    return [encode(text)], text, False


def write_trace(trace, path: str) -> None:
    """The --trace page of every step so far (a write error names the flag)."""
    if trace is None:
        return
    try:
        trace.write(path)
    except OSError as e:
        raise ValueError(f"--trace {path}: cannot write the page ({e.strerror or e})") from None


def run_batch(a, tokenizer, target, kw, prompts: list[list[int]], trace=None) -> None:
    """--prompts FILE: one prompt per line, decoded together as one batch (one section of the --trace page each).
    Ctrl-C: each prompt's tokens so far are printed, the --trace page written, and the interrupt goes on."""
    stats = G.Stats()
    if trace:
        trace.begin(prompts, stats)
    outs = [[] for _ in prompts]
    try:
        G.generate_batch(target, prompts, a.max_new_tokens, stats=stats, on_tokens=lambda b, t: outs[b].extend(t),
                         **kw)
    finally:     # done or interrupted: what each prompt has, and the steps so far
        write_trace(trace, a.trace)
        for t, o in zip(a.prompt_texts, outs):
            M.print0(f"--- {t!r}\n{tokenizer.decode([x for x in o if x not in tokenizer.stop_ids])}")
    M.print0(f"[{len(outs)} prompts, {stats.new_tokens} tokens in {stats.decode_s:.2f} s: "
             f"{stats.new_tokens / max(stats.decode_s, 1e-9):.1f} tok/s in total; mean accept {stats.mean_accept:.2f}]")


def interactive(tokenizer, run, chat_kw: dict, system: list[dict] = (), note: str = "",
                max_seq_len: int | None = None) -> None:
    """Multi-turn chat: each turn renders the whole history (after `system`) through the checkpoint's chat
    template; /reset clears it, /exit or EOF ends. Ctrl-C during an answer abandons that answer; at the prompt it
    ends the program. A history that no longer fits max_seq_len, or a turn the template refuses, is said in one
    line and the turn dropped: the conversation goes on. Under torchrun rank 0 reads the terminal for every rank."""
    M.print0(f"[chat: /reset clears the history, /exit or Ctrl-D ends{note}]")
    history = list(system)
    while (line := _read_line("> ")) is not None and line.strip() != "/exit":
        if line.strip() == "/reset":
            history = list(system)
            M.print0("[history cleared]")
        elif line.strip():
            history.append({"role": "user", "content": line})
            try:
                prompt = tokenizer.apply_chat_template(history, **chat_kw)
            except ValueError as e:
                M.print0(f"[this turn cannot be rendered: {e}]")
                history.pop()
                continue
            if max_seq_len is not None and len(prompt) >= max_seq_len:
                M.print0(f"[the conversation is {len(prompt)} tokens, more than the cache holds (--max-seq-len "
                         f"{max_seq_len}): /reset clears the history]")
                history.pop()
                continue
            try:
                ids = run(prompt)
            except KeyboardInterrupt:
                M.print0("\n[interrupted]")
                history.pop()
                continue
            # what precedes </think> is reasoning: the template decides whether later turns see it
            text = tokenizer.decode([t for t in ids if t not in tokenizer.stop_ids])
            reasoning, think_end, answer = text.rpartition("</think>")
            history.append({"role": "assistant", "content": answer.strip()}
                           | ({"reasoning_content": reasoning.strip()} if think_end else {}))


def _read_line(prompt: str) -> str | None:
    """Rank 0 reads the terminal (None at EOF) and broadcasts the line: every rank decodes the same prompt."""
    box = [None]
    if M.rank == 0:
        try:
            box[0] = input(prompt)
        except EOFError:
            pass
    if M.world_size > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # a ValueError naming the flag (main prints one line), not the usage block
        raise ValueError(f"{message} (see --help)")


class _Help(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # every default shown, except "off" and "chosen at run time"
        shown = action.default not in (None, argparse.SUPPRESS) and action.default is not False
        return action.help + (" (default: %(default)s)" if shown and "%(default)" not in action.help else "")


def budget_arg(v: str) -> int | str:
    """--budget: a node count, or auto."""
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a node count or auto, got {v!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=G.__doc__.split("\n\n")[0], formatter_class=_Help, epilog="""which prompt:
  --prompt, --prompt-ids or --prompts: generate once and exit. With none of them, a terminal on stdin starts a
  chat (multi-turn, through the checkpoint's chat template); any other stdin is read as one prompt.
  The bundled tiny model is a code model, not an assistant: try --prompt "def fib(n):" --raw""")
    p.add_argument("--ckpt", default=G.BUNDLED_TARGET, help="target checkpoint dir (HF safetensors, K2/K2.6 layout), or "
                   "random:k2.6 / random:tiny: K2.6's shapes with random weights (timing; prompts as --prompt-ids)")
    p.add_argument("--draft", default=None, help="DFlash drafter dir (default: the bundled one with the bundled model, "
                   "random:<name>-dflash with random:<name>)")
    p.add_argument("--tokenizer", default=None, help="dir with tiktoken.model, tokenizer_config.json (default: --ckpt)")
    one = p.add_mutually_exclusive_group()
    one.add_argument("--prompt", default=None, help="user message (chat template applied unless --raw)")
    one.add_argument("--prompt-ids", default=None, help="comma-separated token ids (no tokenizer involved)")
    one.add_argument("--prompts", default=None, help="file with one prompt per line: decoded together as a batch")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text as is")
    p.add_argument("--system", default=None, help="a system message before the conversation")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="K2.6 thinking mode on or off (default: the chat template's own choice)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="stop after this many generated tokens")
    p.add_argument("--max-seq-len", type=int, default=4096, help="KV cache length (prompt + generated)")
    p.add_argument("--budget", type=budget_arg, default=8, help="DDTree node budget (0: autoregressive; auto: "
                   f"before each step a tree of {G.AUTO_BUDGET} or one token, whichever commits faster here: a tree "
                   "step's time over a one-token step's, measured at this batch size, against the tokens trees "
                   "commit; at large batches a tree step costs several one-token steps, so trees stop paying and "
                   "auto decodes one token a step)")
    p.add_argument("--chain", action="store_true", help="DFlash chain instead of a tree")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy); one below "
                   f"{verify.MIN_TEMPERATURE:g} is refused, not taken as greedy (logits / T could overflow)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens holding this mass")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--show-tree", action="store_true", help="print each step's tree, then the tokens it committed")
    p.add_argument("--trace", default=None, metavar="FILE.html",
                   help="write every step's tree, the target's token at each node and the accepted path to one page")
    p.add_argument("--device", default=None, help=M.DEVICE_HELP)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="weights and activations (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--no-triton", action="store_true", help="force the PyTorch reference kernels")
    p.add_argument("--cuda-graph", action="store_true", help="replay each step as a captured CUDA graph")
    p.add_argument("--compile", action="store_true", help="torch.compile the fixed-shape step")
    p.add_argument("--eager", action="store_true", help="force the eager reference loop (the default)")
    p.add_argument("--debug", action="store_true", help="NaN/inf checks per layer, TP agreement, full tracebacks")
    p.add_argument("--quiet", action="store_true", help="no loading progress bar")
    return p


if __name__ == "__main__":
    sys.exit(main())
