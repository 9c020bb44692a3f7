"""Sparse RAG on PhantomWiki and NQ (``recipes.sparse_rag.engine``; Zhu et al., ICLR 2025): fine-tune a chat model to rate
each retrieved passage's cache with control tokens and to answer from the kept ones, then compare EM and decode
time per token against dense RAG (all caches), the retriever's top m and the oracle.

Data: a PhantomWiki folder (``--data``) or a generated universe (``--generate SEED``, written into ``--out``):
``rag_jax.data.phantom_rag.prepare_data``'s split (every question kind), a reply correct when it contains every
gold answer; or NQ-open (``--nq [FILE]``, Lost in the Middle's oracle file): the pool of all gold passages, the
split of ``block_nq`` (``--heldout`` 0.2 of the questions, seed ``--seed``), a reply correct when it contains
one of the answers (best-subspan EM). The ``--num-passages`` passages BM25 (or MiniLM) ranks highest per
question, best last in the prompt. Silver relevance labels: a passage is relevant when it is one of the
question's gold passages (PhantomWiki: the sections its Prolog query reads; NQ: its oracle passage).

Training rows (``engine.SparseRAG.assessment_example`` / ``answer_example``), per training question: every
retrieved gold passage rated relevant and ``--negatives`` retrieved others rated irrelevant, and (unless
``--no-train-answers``) the answer given its gold passages among ``--negatives`` others; Block-Attention's 1:1 full/block SFT through ``train/finetune.py``
on the top ``--top-layers`` layers. ``--steps 0`` evaluates the model as loaded (the control tokens untrained
unless ``--model`` is a tuned run folder).

Conditions, greedy, block mode over the passage caches (the same engine for all), per held-out question:
``dense`` (all k caches), ``sparse top-m`` for each of ``--keep`` (the m caches the model rates most likely
relevant), ``sparse p>=0.5``, ``retriever top-m`` (the m best ranked), ``oracle`` (the gold passages). Reported:
accuracy (as above), caches kept, assessment recall of the gold passages, and decode ms per
token measured on ``--time-prompts`` prompts per condition ((time for T tokens - time for 1) / (T - 1)).

    rag-jax eval sparse_rag --data ../shared/data/phantomwiki/depth6_seed11 --steps 120 --out runs/sparse_rag/depth6
    rag-jax eval sparse_rag --nq --num-passages 10 --steps 120 --out runs/sparse_rag/nq
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import jax
import numpy as np

from rag_jax.args import ScriptParser, input_dir, input_file, int_list, integer, model_source, real
from rag_jax.atomic import write_text
from rag_jax.data.loaders import NQ_ORACLE, heldout_split, load_nq_oracle, nq_passage_pool, shared_file
from rag_jax.data.phantom import generate_universe
from rag_jax.data.phantom_rag import TaskConfig, UniverseConfig, answer_text, prepare_data
from rag_jax.evaluation.rag import answer_recall, generate_answers, passage_search
from rag_jax.evaluation.stats import mcnemar
from rag_jax.metrics import best_subspan_em
from rag_jax.evaluation.tables import table
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.model.load import load_model
from rag_jax.recipes.sparse_rag.engine import SparseRAG, add_control_tokens, control_ids, keep
from rag_jax.train.finetune import FinetuneConfig, finetune


def nq_task(path, heldout: float, seed: int) -> tuple[list[dict], list[dict], list[str]]:
    """NQ-open as Sparse RAG's task: ``(train questions, held-out questions, passages)``; a question is
    ``{"question", "gold": [its oracle passage's id], "answers": [...]}`` and the passages are the pool of all gold
    passages (``nq_passage_pool``), titled; the split is ``heldout_split(n, heldout, seed)`` (``block_nq``'s).

    Raises:
      FileNotFoundError / ValueError: a missing or malformed file (``load_nq_oracle``).
    """
    examples = load_nq_oracle(path)
    pool, gold_ids = nq_passage_pool(examples)
    train, held = heldout_split(len(examples), heldout, seed)
    rows = [{"question": x.question, "gold": [g], "answers": list(x.answers)} for x, g in zip(examples, gold_ids)]
    return [rows[i] for i in train], [rows[i] for i in held], [f"(Title: {x.title}) {x.text}" for x in pool]


def is_correct(reply: str, question: dict) -> bool:
    """NQ (``answers``): one answer is a subspan of the reply (best-subspan EM); PhantomWiki (``answer``): the
    reply contains every gold answer."""
    if "answers" in question:
        return bool(best_subspan_em(reply, question["answers"]))
    return answer_recall(reply, question["answer"]) == 1.0


def target_answer(question: dict) -> str:
    """The training answer: NQ's first answer, PhantomWiki's answer list as text."""
    return question["answers"][0] if "answers" in question else answer_text(question["answer"])


def retrieved(search, questions, k: int) -> list[list[int]]:
    """Per question its top-k passage ids, best first."""
    return [[int(j) for j in r if j >= 0] for r in search([q["question"] for q in questions], k)]


def training_examples(engine: SparseRAG, questions, ranked, docs, negatives: int, seed: int,
                      answers: bool = True) -> list:
    """Assessment rows (gold retrieved: relevant; ``negatives`` other retrieved: irrelevant) and, with ``answers``,
    one answer row (gold passages among ``negatives`` others, shuffled) per question."""
    rng = random.Random(seed)
    out = []
    for q, r in zip(questions, ranked):
        gold = set(q["gold"])
        others = [j for j in r if j not in gold][:negatives]
        out += [engine.assessment_example(q["question"], docs[j], True) for j in r if j in gold]
        out += [engine.assessment_example(q["question"], docs[j], False) for j in others]
        if answers:
            shown = sorted(gold)[:4] + others
            rng.shuffle(shown)
            out.append(engine.answer_example(q["question"], [docs[j] for j in shown], target_answer(q)))
    return out


def conditions(p: np.ndarray, ranked: list[int], gold, keeps) -> dict[str, list[int]]:
    """Kept passage ids (best last, as the prompt shows them) per condition for one question."""
    order = ranked[::-1]                       # prompt order: best last
    by_model = lambda idx: [order[i] for i in idx]  # noqa: E731   p is indexed in prompt order
    out = {"dense": order}
    for m in keeps:
        out[f"sparse top-{m}"] = by_model(keep(p, top_m=m))
        out[f"retriever top-{m}"] = ranked[:m][::-1]
    out["sparse p>=0.5"] = by_model(keep(p, threshold=0.5))
    out["oracle"] = list(gold)
    return out


def decode_ms(ba, prompts, tokens: int, eos) -> float:
    """Median decode time per token (ms) over ``prompts``: (T tokens - 1 token) / (T - 1), after a warm-up."""
    times = []
    for blocks in prompts:
        run = lambda n: ba.generate([blocks], max_new_tokens=n, mode="block", eos_id=None)  # noqa: E731
        run(1), run(tokens)
        t0 = time.perf_counter()
        run(1)
        t1 = time.perf_counter()
        run(tokens)
        t2 = time.perf_counter()
        times.append(((t2 - t1) - (t1 - t0)) / (tokens - 1) * 1e3)
    return float(np.median(times)) if times else float("nan")


def parser() -> ScriptParser:
    p = ScriptParser(prog="rag-jax eval sparse_rag", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct",
                   help="base model (control tokens added) or a run folder already tuned with them")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=input_dir, help="a PhantomWiki folder")
    src.add_argument("--generate", type=integer(0), help="generate a universe with this seed into --out")
    src.add_argument("--nq", type=input_file, nargs="?", const=str(shared_file(*NQ_ORACLE)), default=None,
                     help="NQ-open (the shared Lost in the Middle oracle file, or this one)")
    p.add_argument("--heldout", type=real(0, 1, lo_open=True, hi_open=True), default=0.2,
                   help="with --nq: fraction of the questions held out (block_nq's split)")
    p.add_argument("--retriever", choices=("bm25", "minilm"), default="bm25")
    p.add_argument("--num-passages", type=integer(2), default=10)
    p.add_argument("--negatives", type=integer(0), default=2, help="irrelevant passages per training question")
    p.add_argument("--train-questions", type=integer(1), default=200)
    p.add_argument("--train-answers", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the answers from gold + negative passages (off: the assessment rows only, "
                        "several times shorter)")
    p.add_argument("--eval-questions", type=integer(1), default=40)
    p.add_argument("--steps", type=integer(0), default=100)
    p.add_argument("--batch-size", type=integer(1), default=4)
    p.add_argument("--top-layers", type=integer(0), default=8)
    p.add_argument("--lora-rank", type=integer(0), default=0,
                   help="train rank-R LoRA adapters (flax nnx.LoRA) on the top layers' projections instead of "
                        "their weights; 0 = the weights")
    p.add_argument("--lr", type=real(0, lo_open=True), default=2e-4)
    p.add_argument("--warmup", type=integer(0), default=5)
    p.add_argument("--keep", type=int_list(1), default=[1, 2, 3, 5], help="caches kept (m) for the top-m rows")
    p.add_argument("--max-new-tokens", type=integer(2), default=24)
    p.add_argument("--time-prompts", type=integer(0), default=3)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--out", type=Path, default=Path("runs/sparse_rag"))
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if args.nq is not None:
        folder, (train_questions, eval_questions, docs) = args.nq, nq_task(args.nq, args.heldout, args.seed)
    else:
        folder = args.data or generate_universe(100, args.generate, max_hops=3, num_questions=800).save(
            args.out / f"universe_seed{args.generate}")
        data = prepare_data(UniverseConfig(), TaskConfig(questions="all", max_hops=3,
                                                         num_passages=args.num_passages), folder)
        train_questions, eval_questions = data.train_questions, data.eval_questions
        docs = [x["text"] for x in data.eval_passages]
    search = passage_search(args.retriever, docs)
    loaded = load_model(args.model)
    try:
        control_ids(loaded.tokenizer)
    except ValueError:
        loaded = add_control_tokens(loaded)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "data": str(folder)}
    if args.steps:
        train_q = train_questions[:args.train_questions]
        engine = SparseRAG(loaded, BlockAttention(loaded.model))
        examples = training_examples(engine, train_q, retrieved(search, train_q, args.num_passages), docs,
                                     args.negatives, args.seed, args.train_answers)
        fits = [e for e in examples if e.num_tokens <= loaded.config.max_seq_len]
        report["dropped_rows"] = len(examples) - len(fits)          # longer than the model's window
        examples = fits
        cfg = FinetuneConfig(steps=args.steps, batch_size=args.batch_size, train_layers=args.top_layers,
                             learning_rate=args.lr, warmup_steps=args.warmup, seed=args.seed,
                             seq_len=max(e.num_tokens for e in examples), save_every=max(args.steps // 4, 1),
                             lora_rank=args.lora_rank)
        t0 = time.perf_counter()
        finetune(loaded, examples, cfg, args.out / "run")
        loaded = load_model(str(args.out / "run"))
        report["finetune"] = {"rows": len(examples), "seconds": time.perf_counter() - t0, "run_dir": str(args.out / "run")}
    report.update(evaluate(loaded, eval_questions[:args.eval_questions], docs, search, args))
    report["seconds"] = time.perf_counter() - t_start
    write_text(args.out / "report.json", json.dumps(report, indent=1))
    print_report(report)
    print(f"# wrote {args.out / 'report.json'}")
    return 0


def evaluate(loaded, questions, docs, search, args) -> dict:
    """Assess every held-out question's passages, answer under every condition, time decoding."""
    ba = BlockAttention(loaded.model, store=KVStore(max_bytes=1 << 30), fingerprint=str(loaded.source))
    engine = SparseRAG(loaded, ba)
    ranked = retrieved(search, questions, args.num_passages)
    probs = [engine.assess(q["question"], [docs[j] for j in r[::-1]]) for q, r in zip(questions, ranked)]
    chosen = [conditions(p, r, q["gold"], args.keep) for p, r, q in zip(probs, ranked, questions)]
    results = {}
    for name in chosen[0]:
        prompts = [engine.chat.blocks(q["question"], [docs[j] for j in c[name]]) for q, c in zip(questions, chosen)]
        replies = generate_answers(ba, loaded.tokenizer, prompts, mode="block", max_new_tokens=args.max_new_tokens,
                                   batch_size=8, eos_id=loaded.eos_ids)
        correct = [is_correct(a, q) for a, q in zip(replies, questions)]
        gold_kept = [len(set(c[name]) & set(q["gold"])) / len(q["gold"]) for c, q in zip(chosen, questions)]
        results[name] = {"accuracy": float(np.mean(correct)), "correct": correct, "replies": replies,
                         "caches": float(np.mean([len(c[name]) for c in chosen])),
                         "gold_kept": float(np.mean(gold_kept)),
                         "decode_ms": decode_ms(ba, prompts[:args.time_prompts], args.max_new_tokens, loaded.eos_ids)}
        # every condition compiles its own cache shapes; dropping the executables keeps the process under the
        # kernel's memory-map limit (an NQ run died in LLVM with "Cannot allocate memory" after ~9 conditions)
        jax.clear_caches()
    dense = results["dense"]["correct"]
    for r in results.values():
        r["vs_dense"] = dict(zip(("only_this", "only_dense", "p"), mcnemar(r["correct"], dense)))
    labels = [(q["gold"], r) for q, r in zip(questions, ranked)]
    return {"questions": len(questions), "results": results,
            "assessment": {"p_relevant": [p.tolist() for p in probs],
                           "auc": _auc([p[::-1] for p in probs], labels)}}


def _auc(probs, labels) -> float:
    """ROC AUC of P(relevant) for the gold passages among each question's retrieved ones (pooled)."""
    pos, neg = [], []
    for p, (gold, r) in zip(probs, labels):
        for score, j in zip(p, r):
            (pos if j in set(gold) else neg).append(score)
    if not pos or not neg:
        return float("nan")
    pos, neg = np.asarray(pos), np.asarray(neg)
    return float((np.mean(pos[:, None] > neg[None]) + 0.5 * np.mean(pos[:, None] == neg[None])))


def print_report(report: dict) -> None:
    print(f"# Sparse RAG, {report['data']}: {report['questions']} held-out questions; assessment AUC "
          f"{report['assessment']['auc']:.3f}")
    print(table(["condition", "accuracy", "caches kept", "gold kept", "decode ms/token", "vs dense (this/dense, p)"],
                [[n, r["accuracy"], r["caches"], r["gold_kept"], r["decode_ms"],
                  f"{r['vs_dense']['only_this']}/{r['vs_dense']['only_dense']}, {r['vs_dense']['p']:.3f}"]
                 for n, r in report["results"].items()], floatfmt=".3f"))
