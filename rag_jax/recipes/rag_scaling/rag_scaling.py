"""Inference scaling for RAG on PhantomWiki: DRAG and IterDRAG over a grid of (k, m, n), the computation
allocation model (Yue et al., ICLR 2025), and a RAGGED depth sweep (Hsia et al., ICML 2025).

``--data`` is a PhantomWiki folder (the shared ``depth6_seed11``), or ``--generate SEED`` writes a universe
(``rag_jax.data.phantom.generate_universe``, 100 people, up to ``--max-hops`` hops) into the run folder first.
Questions: the held-out split of ``rag_jax.data.phantom_rag.prepare_data`` (``--questions all``: every kind),
the first ``--limit``; demonstrations: the first training questions of 2+ hops. Retrieval over the universe's
section passages: BM25 (``rag_jax.retrieval.lexical``) or MiniLM embeddings (exact search).

Runs, each reply cached in ``--out``/replies.json (a rerun or a larger grid recomputes nothing it has):
1. DRAG on ``--ks`` x ``--ms`` (n = 1), IterDRAG (oracle sub-queries, labelled as an upper bound, and the model's
   own) on ``--iter-ks`` x ``--iter-ms`` x ``--steps``, with ``--retriever`` and ``--mode``.
2. Per budget (effective context length, powers of 2): the best configuration measured, plain RAG's (m = 0,
   n = 1, largest k that fits) and the allocation model's choice (``allocation``; leave-one-out predictions, so a
   configuration is never chosen by a fit that saw it), and the slope of the best accuracy per doubling.
3. RAGGED: accuracy vs ``--ragged-ks`` (m = 0, n = 1) per retriever x attention mode, with ``ragged``'s scores.
4. Block-Attention's saving: time to first token of DRAG prompts with m cached demonstrations (and documents)
   vs re-encoding them under full attention.

Accuracy: a reply is correct when it contains every gold answer (SQuAD-normalized, as best-subspan EM; the
chat model answers in sentences); also the mean fraction of gold answers contained and PhantomWiki's set-F1.
Output: ``report.json``, ``scaling.png`` (best accuracy vs effective context length, log scale), ``ragged.png``.

    rag-jax eval rag_scaling --data ../shared/data/phantomwiki/depth6_seed11 --limit 40 --out runs/rag_scaling/depth6
    rag-jax eval rag_scaling --generate 3 --limit 40 --out runs/rag_scaling/generated3
"""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np

from rag_jax.args import ScriptParser, input_dir, int_list, integer, model_source, names
from rag_jax.atomic import write_text
from rag_jax.data.loaders import load_phantomwiki
from rag_jax.data.phantom import FactBase, generate_universe
from rag_jax.data.phantom_rag import TaskConfig, UniverseConfig, prepare_data
from rag_jax.evaluation.plots import line_plot
from rag_jax.evaluation.rag import answer_recall, passage_search, score_answer
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import median_ms
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.model.load import load_model
from rag_jax.recipes.rag_scaling import allocation
from rag_jax.recipes.rag_scaling.ragged import ragged_scores
from rag_jax.recipes.rag_scaling.runner import Runner, demonstrations

RETRIEVERS, MODES, METHODS = ("bm25", "minilm"), ("full", "block"), ("DRAG", "IterDRAG-oracle", "IterDRAG-own")


def scores(reply: str, golds) -> dict:
    """``correct`` (every gold answer contained), ``answer_recall`` (the fraction contained) and set-F1."""
    recall = answer_recall(reply, golds)
    return {"correct": float(recall == 1.0), "answer_recall": recall, "set_f1": score_answer(reply, golds)["set_f1"]}


def load_data(args):
    """The universe folder, ``prepare_data``'s split, the facts, and the demonstration pool."""
    folder = args.data
    if folder is None:
        folder = generate_universe(100, args.generate, max_hops=args.max_hops, num_questions=400).save(
            args.out / f"universe_seed{args.generate}")
    task = TaskConfig(questions=args.questions, max_hops=args.max_hops, num_passages=max(args.ks + [1]))
    data = prepare_data(UniverseConfig(), task, folder)
    facts = FactBase.from_articles({"title": a.title, "facts": a.facts} for a in load_phantomwiki(folder).articles)
    pool = sorted(data.train_questions, key=lambda q: q["hops"] < 2)[:max(args.ms + args.iter_ms + args.time_ms)]
    return folder, data, facts, pool


def run_config(runner: Runner, method: str, questions, k: int, m: int, n: int) -> dict:
    t0 = time.perf_counter()
    texts = [q["question"] for q in questions]
    if method == "DRAG":
        calls = runner.drag(texts, k, m)
    elif method == "IterDRAG-oracle":
        calls = runner.iter_oracle(texts, k, m, n)
    else:
        calls = runner.iter_own(texts, k, m, n)
    rows = [scores(a, q["answer"]) for a, q in zip(calls.answers, questions)]
    return {"method": method, "k": k, "m": m, "n": n, "retriever": runner.retriever, "mode": runner.mode,
            "length": float(np.mean(calls.lengths)), "calls": float(np.mean(calls.calls)),
            "truncated": calls.truncated, "seconds": time.perf_counter() - t0,
            **{key: float(np.mean([r[key] for r in rows])) for key in rows[0]},
            "per_question": [r["correct"] for r in rows], "replies": calls.answers}


def budget_table(grid: list[dict], num_questions: int) -> dict:
    """Best measured / plain RAG / allocation-model choice per power-of-2 budget, and the model's fit."""
    k, m, n, acc, lengths = (np.array([g[f] for g in grid], np.float64) for f in ("k", "m", "n", "correct", "length"))
    acc_by = {(int(g["k"]), int(g["m"]), int(g["n"])): g["correct"] for g in grid if g["method"] != "IterDRAG-own"}
    info = None
    try:
        info = allocation.informativeness(acc_by).tolist()
    except KeyError:
        pass
    fit_rows = [j for j, g in enumerate(grid) if g["method"] != "IterDRAG-own"]
    sel = np.array(fit_rows)
    loo = allocation.leave_one_out(k[sel], m[sel], n[sel], acc[sel], num_questions)
    model = allocation.AllocationModel.fit(k[sel], m[sel], n[sel], acc[sel], num_questions)
    in_sample = model.predict(k[sel], m[sel], n[sel])
    predicted = np.full(len(grid), -1.0)
    predicted[sel] = loo
    budgets = [int(2 ** e) for e in range(int(np.floor(np.log2(lengths.min()))) + 1,
                                          int(np.ceil(np.log2(lengths.max()))) + 1)]
    rows = []
    plain = [g["method"] == "DRAG" and g["m"] == 0 for g in grid]
    for b in budgets:
        best = allocation.best_under_budget(lengths, acc, b)
        rag = allocation.best_under_budget(lengths, k, b, allowed=plain)   # plain RAG: the most documents that fit
        chosen = allocation.best_under_budget(lengths, predicted, b, allowed=predicted >= 0)
        if best is None:
            continue
        rows.append({"budget": b, "best": grid[best]["correct"], "best_config": _name(grid[best]),
                     "rag": None if rag is None else grid[rag]["correct"],
                     "rag_config": None if rag is None else _name(grid[rag]),
                     "model": None if chosen is None else grid[chosen]["correct"],
                     "model_config": None if chosen is None else _name(grid[chosen])})
    return {"budgets": rows, "slope_per_doubling": allocation.slope_per_doubling(
                [r["budget"] for r in rows], [r["best"] for r in rows]),
            "model": {"a": model.a.tolist(), "c": model.c, "informativeness": info,
                      "loo_mae": float(np.mean(np.abs(loo - acc[sel]))),
                      "in_sample_mae": float(np.mean(np.abs(in_sample - acc[sel]))), "configs": len(sel)}}


def _name(g: dict) -> str:
    return f"{g['method']} k={g['k']} m={g['m']}" + (f" n={g['n']}" if g["method"] != "DRAG" else "")


def block_saving(runner_block: Runner, question: str, k: int, ms, repeats: int) -> list[dict]:
    """TTFT (ms, median) of one DRAG prompt per m: full prefill vs Block-Attention over warm caches."""
    import jax

    out = []
    hits = runner_block._retrieve([question], k)[0]
    for m in ms:
        blocks, _ = runner_block.prompt(question, hits[::-1], runner_block.drag_demos[:m])
        ba = runner_block.ba
        full = median_ms(lambda: jax.block_until_ready(ba.prefill(blocks, mode="full", last_only=True).logits), repeats)
        cached = median_ms(lambda: jax.block_until_ready(ba.prefill(blocks, mode="block", last_only=True).logits),
                           repeats)
        out.append({"m": m, "k": k, "prompt_tokens": sum(map(len, blocks)), "full_ms": full, "cached_ms": cached,
                    "speedup": full / cached})
    return out


def parser() -> ScriptParser:
    p = ScriptParser(prog="rag-jax eval rag_scaling", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=input_dir, help="a PhantomWiki folder")
    src.add_argument("--generate", type=integer(0), help="generate a universe with this seed into --out")
    p.add_argument("--questions", choices=("all", "attribute", "evidence"), default="all")
    p.add_argument("--max-hops", type=integer(1), default=3)
    p.add_argument("--limit", type=integer(1), default=40, help="held-out questions")
    p.add_argument("--ks", type=int_list(0), default=[0, 1, 3, 10, 30], help="DRAG documents")
    p.add_argument("--ms", type=int_list(0), default=[0, 1, 4], help="DRAG demonstrations")
    p.add_argument("--iter-ks", type=int_list(1), default=[3, 10])
    p.add_argument("--iter-ms", type=int_list(0), default=[1])
    p.add_argument("--steps", type=int_list(2), default=[2, 3], help="IterDRAG's n (generation steps)")
    p.add_argument("--methods", type=names(METHODS[1:]), default=list(METHODS[1:]), help="IterDRAG variants")
    p.add_argument("--demo-docs", type=integer(1), default=2, help="documents per demonstration")
    p.add_argument("--retriever", choices=RETRIEVERS, default="bm25")
    p.add_argument("--mode", choices=MODES, default="full")
    p.add_argument("--ragged-ks", type=int_list(0), default=[0, 1, 3, 10, 30])
    p.add_argument("--ragged", type=names(RETRIEVERS), default=list(RETRIEVERS), help="retrievers of the sweep")
    p.add_argument("--ragged-modes", type=names(MODES), default=list(MODES))
    p.add_argument("--time-k", type=integer(0), default=10, help="documents in the Block-Attention timing prompts")
    p.add_argument("--time-ms", type=int_list(1), default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=integer(1), default=3)
    p.add_argument("--max-new-tokens", type=integer(1), default=32)
    p.add_argument("--batch-size", type=integer(1), default=8)
    p.add_argument("--out", type=Path, default=Path("runs/rag_scaling"))
    return p


class Runners:
    """One ``Runner`` per (retriever, attention mode), sharing the model, its KV store and the retrievers."""

    def __init__(self, args, data, facts, pool):
        self.args, self.data, self.facts, self.pool = args, data, facts, pool
        self.docs = [x["text"] for x in data.eval_passages]
        self.loaded = load_model(args.model)
        self.ba = BlockAttention(self.loaded.model, store=KVStore(max_bytes=1 << 30),
                                 fingerprint=str(self.loaded.source), prefix=self.loaded.block_prefix)
        self.searches, self.demos = {}, {}

    def __call__(self, retriever: str, mode: str) -> Runner:
        if retriever not in self.searches:
            train_docs = [x["text"] for x in self.data.train_passages]
            self.searches[retriever] = passage_search(retriever, self.docs)
            self.demos[retriever] = demonstrations(self.pool, train_docs, passage_search(retriever, train_docs),
                                                   self.facts, self.args.demo_docs)
        drag_demos, iter_demos = self.demos[retriever]
        return Runner(self.loaded, self.ba, self.docs, self.searches[retriever], drag_demos=drag_demos,
                   iter_demos=iter_demos, mode=mode, max_new_tokens=self.args.max_new_tokens,
                   batch_size=self.args.batch_size, cache=self.args.out / "replies.json",
                   fingerprint=f"{self.loaded.source}:{self.args.model}", retriever=retriever)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    folder, data, facts, pool = load_data(args)
    questions = data.eval_questions[:args.limit]
    runners = Runners(args, data, facts, pool)
    report = {"args": {key: str(v) for key, v in vars(args).items()}, "data": str(folder),
              "questions": len(questions), "passages": len(runners.docs), "grid": [], "ragged": []}
    out_json = args.out / "report.json"

    def save():
        write_text(out_json, json.dumps(report, indent=1))

    main_runner = runners(args.retriever, args.mode)
    configs = [("DRAG", k, m, 1) for m, k in itertools.product(args.ms, args.ks)]
    configs += [(meth, k, m, n) for meth in args.methods for m in args.iter_ms for k in args.iter_ks for n in args.steps]
    for meth, k, m, n in configs:
        row = run_config(main_runner, meth, questions, k, m, n)
        report["grid"].append(row)
        print(f"  {_name(row):34s} length {row['length']:7.0f}  correct {row['correct']:.3f}  "
              f"recall {row['answer_recall']:.3f}  set-F1 {row['set_f1']:.3f}  {row['seconds']:.0f} s", flush=True)
        save()
    report["allocation"] = budget_table(report["grid"], len(questions))
    save()
    for retriever, mode in itertools.product(args.ragged, args.ragged_modes):
        rows = [run_config(runners(retriever, mode), "DRAG", questions, k, 0, 1) for k in args.ragged_ks]
        summary = ragged_scores(args.ragged_ks, [x["per_question"] for x in rows])
        report["ragged"].append({"retriever": retriever, "mode": mode, "ks": args.ragged_ks, **summary,
                                 "correct": [x["per_question"] for x in rows], "seconds": sum(x["seconds"] for x in rows)})
        print(f"  RAGGED {retriever:6s} {mode:5s} " + " ".join(f"{a:.3f}" for a in summary["accuracy"])
              + f"  -> {summary['behaviour']}", flush=True)
        save()
    report["block_saving"] = block_saving(runners(args.retriever, "block"), questions[0]["question"], args.time_k,
                                          args.time_ms, args.repeats)
    report["seconds"] = time.perf_counter() - t_start
    report["files"] = write_plots(report, args.out)
    save()
    print_report(report)
    print(f"# wrote {out_json}")
    return 0


def write_plots(report: dict, out: Path) -> dict:
    series = []
    for label, keep in (("plain RAG (m=0, n=1)", lambda g: g["method"] == "DRAG" and g["m"] == 0),
                        ("DRAG", lambda g: g["method"] == "DRAG"),
                        ("DRAG + IterDRAG (oracle)", lambda g: g["method"] != "IterDRAG-own"),
                        ("DRAG + IterDRAG (own)", lambda g: g["method"] != "IterDRAG-oracle")):
        grid = [g for g in report["grid"] if keep(g)]
        lengths, acc = [g["length"] for g in grid], [g["correct"] for g in grid]
        xs, ys = [], []
        for b in [r["budget"] for r in report["allocation"]["budgets"]]:
            j = allocation.best_under_budget(lengths, acc, b)
            if j is not None:
                xs.append(b)
                ys.append(acc[j])
        series.append((xs, ys, label))
    files = {"scaling": line_plot(out / "scaling.png", series, xlabel="effective context length (tokens, budget)",
                                  ylabel="best accuracy within budget", title="Inference scaling for RAG",
                                  style="o-", logx=True, ylim=(0, 1))}
    if report["ragged"]:
        files["ragged"] = line_plot(out / "ragged.png",
                                    [(r["ks"], r["accuracy"], f"{r['retriever']}, {r['mode']}") for r in report["ragged"]],
                                    xlabel="retrieved documents k", ylabel="accuracy", title="RAGGED depth sweep",
                                    style="o-", ylim=(0, 1))
    return files


def print_report(report: dict) -> None:
    print(f"# {report['data']}: {report['questions']} held-out questions, {report['passages']} passages, "
          f"{report['seconds']:.0f} s")
    print(table(["configuration", "eff. length", "calls", "correct", "answer recall", "set-F1", "seconds"],
                [[_name(g), g["length"], g["calls"], g["correct"], g["answer_recall"], g["set_f1"], g["seconds"]]
                 for g in report["grid"]], floatfmt=(".3f", ".0f", ".1f", ".3f", ".3f", ".3f", ".0f")))
    a = report["allocation"]
    print(f"# allocation model: a = {np.round(a['model']['a'], 3).tolist()}, c = {a['model']['c']:.3f}; "
          f"leave-one-out MAE {a['model']['loo_mae']:.3f} (in-sample {a['model']['in_sample_mae']:.3f}) over "
          f"{a['model']['configs']} configurations; best accuracy per doubling of budget {a['slope_per_doubling']:+.3f}")
    print(table(["budget", "best", "best configuration", "plain RAG", "RAG configuration", "model's choice",
                 "chosen configuration"],
                [[r["budget"], r["best"], r["best_config"], r["rag"], r["rag_config"], r["model"], r["model_config"]]
                 for r in a["budgets"]]))
    if report["ragged"]:
        ks = report["ragged"][0]["ks"]
        print(table(["retriever", "mode", *[f"k={k}" for k in ks], "k*", "stability", "scalability", "behaviour"],
                    [[r["retriever"], r["mode"], *r["accuracy"], r["k_star"], r["stability"], r["scalability"],
                      r["behaviour"]] for r in report["ragged"]]))
    print(table(["m", "k", "prompt tokens", "full ms", "cached ms", "speed-up"],
                [[x["m"], x["k"], x["prompt_tokens"], x["full_ms"], x["cached_ms"], x["speedup"]]
                 for x in report["block_saving"]], floatfmt=".1f"))
