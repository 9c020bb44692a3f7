"""Latency of GRIT's RAG caching modes vs plain RAG, per document length (GritLM, ICLR 2025, §4, Table 7).

For each document length the script times, in one process, the median of ``--repeats`` warm greedy
answers of ``--new_tokens`` tokens (the paper: 16) for one (query, doc) request (``GritCache``):

- ``rag_doc_first`` / ``rag_query_first``: plain RAG, the whole prompt prefilled causally;
- ``doc``: Doc Caching — the doc's KV from the embedding pass is in the ``KVStore`` (computed at index
  time, not timed), only the short query prompt is prefilled over it;
- ``query``: Query Caching — the query's KV is cached, the doc prompt is prefilled;
- ``query_doc`` / ``doc_query``: both KVs cached, only the instruction prompt is prefilled.

Sample A (the paper's): a short query and a long doc, so Doc Caching should win; ``--sample B`` swaps
the lengths (the query is the long text), where Query Caching wins. ``change`` = latency relative to the
RAG baseline with the same text first (doc modes vs ``rag_doc_first``, query modes vs
``rag_query_first``); the paper's CPU figure at 4000 tokens is -63% for Doc Caching (14.18 s -> 5.25 s).
Weights are random (latency does not depend on them) unless ``--model`` loads a pretrained model (its
tokenizer then encodes the texts and its BOS/EOS text fill GritLM's prompt strings); text is random words.
``--threads 1 --clock cpu``: one XLA thread, CPU time of the process (stable on a shared, busy machine).

    rag-jax bench grit_caching                               # 500,1000,2000,4000 tokens, cpu-small model
    rag-jax bench grit_caching --sizes 500,1000 --repeats 3  # quicker
    rag-jax bench grit_caching --preset llama3.2-1b --dtype bfloat16   # larger model (GPU)
    rag-jax bench grit_caching --model smollm2-135m-instruct --modes rag_doc_first,doc --threads 1 --clock cpu
"""
from __future__ import annotations


import jax
import numpy as np
from flax import nnx

from rag_jax.args import ScriptParser, int_list, integer, model_source, names
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import clock_fn, cpu_threads, median_ms
from rag_jax.inference.grit_cache import GritCache
from rag_jax.inference.kv_store import KVStore
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.config import PRESETS, SUPPORTED_DTYPES
from rag_jax.model.embedding import GritFormat
from rag_jax.model.load import load_model
from rag_jax.tokenizer import train_bpe

MODES = ("rag_doc_first", "doc", "doc_query", "rag_query_first", "query", "query_doc")
BASELINE = {"doc": "rag_doc_first", "doc_query": "rag_doc_first", "query": "rag_query_first",
            "query_doc": "rag_query_first"}


def make_text(tokenizer, rng, words, n_tokens: int) -> str:
    """Random words whose tokenization is ``n_tokens`` long (to within one word)."""
    text = ""
    while len(tokenizer.encode(text).ids) < n_tokens:
        text += " ".join(rng.choice(words, max(1, (n_tokens - len(tokenizer.encode(text).ids)) // 2))) + " "
    pieces = text.split()
    lo, hi = 1, len(pieces)
    while lo < hi:  # the fewest words reaching n_tokens
        mid = (lo + hi) // 2
        if len(tokenizer.encode(" ".join(pieces[:mid])).ids) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(pieces[:lo])


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax bench grit_caching", description=__doc__)
    p.add_argument("--sizes", type=int_list(1), default="500,1000,2000,4000", help="long-text lengths in tokens")
    p.add_argument("--sample", choices=("A", "B"), default="A", help="A: long doc, short query; B: the reverse")
    p.add_argument("--short_len", type=integer(1), default=8, help="tokens of the short text")
    p.add_argument("--repeats", type=integer(1), default=5, help="timed runs per cell (median)")
    p.add_argument("--new_tokens", type=integer(1), default=16, help="generated tokens per answer")
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS), help="model preset (random weights)")
    p.add_argument("--model", type=model_source, default=None,
                   help="pretrained model instead of --preset: an embedded name (smollm2-135m-instruct), a .gguf "
                        "file or an HF folder (rag_jax.model.load.load_model)")
    p.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES, help="compute/param dtype")
    p.add_argument("--modes", type=names(MODES), default=",".join(MODES),
                   help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--threads", type=integer(0), default=0,
                   help="cores: this process pinned (CPU affinity) to the first N cores (0 = unpinned; 1 = stable numbers on a "
                        "busy machine)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: elapsed time; cpu: CPU time of this process (use with --threads 1)")
    args = p.parse_args(argv)
    sizes, modes = args.sizes, args.modes
    cpu_threads(args.threads)
    clock = clock_fn(args.clock)

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(3, 9))) for _ in range(2000)]
    # Longest prompt: a long text, a short one, the instruction prompts (< 64 tokens), the answer.
    need = max(sizes) + 2 * args.short_len + args.new_tokens + 64
    if args.model:
        loaded = load_model(args.model, dtype=args.dtype)
        model, tokenizer, cfg = loaded.model, loaded.tokenizer, loaded.config
        if tokenizer is None:
            p.error(f"argument --model: {args.model} has no tokenizer")
        if need > cfg.max_seq_len:
            p.error(f"argument --sizes: up to {max(sizes)} tokens (+ prompts) exceeds {args.model}'s "
                    f"max_seq_len={cfg.max_seq_len}")
        special = loaded.special_tokens
        fmt = GritFormat(bos=special.get("bos_token") or "", eos=special.get("eos_token") or "")
        name = args.model
    else:
        corpus = [" ".join(rng.choice(words, 50)) for _ in range(400)]
        corpus += ["<|user|>\n<|embed|>\n<|assistant|>\nThe answer is Answer the prior query while optionally using "
                   "the context prior to it Optionally using the prior context answer the query prior to it"] * 20
        tokenizer = train_bpe(corpus, 2048, special_tokens=("<pad>", "<s>", "</s>", "<unk>"))
        cfg = ModelConfig.preset(args.preset, dtype=args.dtype, param_dtype=args.dtype, max_seq_len=need + 192)
        model, fmt, name = Transformer(cfg, rngs=nnx.Rngs(0)), GritFormat(), args.preset
    gc = GritCache(nnx.split(model), tokenizer, store=KVStore(8 << 30), fmt=fmt)
    print(f"model {name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {args.dtype}); sample "
          f"{args.sample}; {args.new_tokens} new tokens; median of {args.repeats}; backend {jax.default_backend()}; "
          f"threads {args.threads or 'default'}; clock {args.clock}", flush=True)

    short = make_text(tokenizer, rng, words, args.short_len)
    rows = []
    for n in sizes:
        long = make_text(tokenizer, rng, words, n)
        query, doc = (short, long) if args.sample == "A" else (long, short)
        # one warm-up run per mode: compile and fill the store
        times = {m: median_ms(lambda m=m: gc.generate(m, query, doc, max_new_tokens=args.new_tokens), args.repeats,
                              clock=clock)
                 for m in modes}
        rows.append((n, times))
        print(f"  {n} tokens: " + ", ".join(f"{m} {t:.0f} ms" for m, t in times.items()), flush=True)

    compared = [m for m in modes if m in BASELINE and BASELINE[m] in modes]
    print(f"\n{args.clock} time, median ms")
    print(table(["long text (tokens)", *(f"{m} (ms)" for m in modes), *(f"{m} change %" for m in compared)],
                       [[n, *(t[m] for m in modes), *(100 * (t[m] / t[BASELINE[m]] - 1) for m in compared)]
                        for n, t in rows],
                       floatfmt=("",) + (".0f",) * len(modes) + ("+.0f",) * len(compared)))
    return 0
