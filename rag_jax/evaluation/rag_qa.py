"""Retrieval-augmented QA with a model (``--model``: a ``rag-jax demo`` run folder, or any run / HF folder):
PhantomWiki folders and the NQ-open oracle.

Metrics (``rag_jax.metrics`` via ``rag_jax.evaluation.rag.score_answer``; research note retrieval_eval.md §2):
SQuAD-normalized exact match (EM), token F1, best-subspan EM (gold is a substring of the prediction,
Lost in the Middle) and PhantomWiki's set EM / set-F1 (split on commas, lowercase, compare as sets).

- PhantomWiki folder (``articles.json`` + ``questions.json``): the questions the demo would hold out
  (same selection, section passages and seeded split as ``rag-jax demo --data``; ``--split all``
  scores every selected question). Conditions: no retrieval; the top-k passages of a ScaNN index
  (MiniLM or the model in GRIT embedding mode) under full attention and under Block-Attention
  with KV reuse; the gold passage(s) forced into the top k. For answer sets the SQuAD metrics compare against the
  comma-joined set.
- NQ-open oracle (``nq-open-oracle.jsonl.gz``, Liu et al. 2024): each question with its gold passage
  (oracle context; full and block attention) and without context. Answers are alternatives: every
  metric is the best over them. Passages longer than the model's window are truncated.

A demo model trained on a fictional universe is not expected to answer NQ; the NQ rows show the
pipeline and the metrics on real data (a model trained with ``--config`` at scale would). A run folder's
``config.yaml`` gives the task, retriever and GRIT settings (``rag_jax.evaluation.models.rag_settings``).

    rag-jax eval rag_qa --model runs/demo --data ../shared/data/phantomwiki/depth6_seed11
    rag-jax eval rag_qa --model runs/demo --data ../shared/data/lost_in_the_middle/nq-open-oracle.jsonl.gz --limit 200
"""
from __future__ import annotations

import json
from pathlib import Path

from rag_jax.atomic import write_text
from rag_jax.data import phantom_rag
from rag_jax.data.block_rag import encode
from rag_jax.data.loaders import load_nq_oracle
from rag_jax.args import ScriptParser, input_dir, input_path, integer, output_file
from rag_jax.evaluation.models import load_rag_model
from rag_jax.evaluation.rag import generate_answers, mean_scores, retrieval_eval, score_answer, with_gold
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.model.embedding import GritEmbedder
from rag_jax.retrieval.embedders import BertEmbedder

METRICS = ("em", "f1", "subspan_em", "set_em", "set_f1")


def _score(preds: list[str], golds: list[list[str]], golds_are_set: bool) -> dict:
    return mean_scores([score_answer(p, g, golds_are_set=golds_are_set) for p, g in zip(preds, golds)])


def _answer_conditions(plan, prompts: dict, golds, golds_are_set: bool, tokenizer, ba, args) -> tuple[dict, list]:
    """Greedy answers and mean scores per ``(label, prompts key, mode)`` of ``plan``; seconds per condition."""
    results, shown, timer = {}, [], StageTimer()
    for label, which, mode in plan:
        preds = generate_answers(ba, tokenizer, prompts[which], mode=mode, max_new_tokens=args.max_new_tokens,
                                 batch_size=args.batch_size)
        timer.stage(label)
        results[label] = {**_score(preds, golds, golds_are_set), "seconds": timer.wall[label]}
        shown.append({label: preds[:5]})
    return results, shown


def _fit(blocks: list[list[int]], max_len: int) -> list[list[int]]:
    """Truncate the passage blocks (not the question block) so the prompt fits ``max_len`` tokens."""
    room = max_len - len(blocks[-1])
    out = []
    for b in blocks[:-1]:
        if room <= 0:
            break
        out.append(list(b[:room]))
        room -= len(out[-1])
    return out + [list(blocks[-1])]


def eval_phantomwiki(args, settings, model, tokenizer) -> tuple[dict, list[dict]]:
    import dataclasses

    task = dataclasses.replace(settings.task, **{k: v for k, v in (("questions", args.questions),
                                                                    ("max_hops", args.max_hops)) if v is not None})
    data = phantom_rag.prepare_data(settings.universe, task, args.data)
    questions = data.eval_questions if args.split == "heldout" else data.eval_questions + data.train_questions
    questions = questions[:args.limit] if args.limit else questions
    k = task.num_passages
    if args.retriever == "minilm":
        emb = BertEmbedder()
        embed_docs = embed_queries = emb.embed
    else:
        grit = GritEmbedder(model, tokenizer, max_length=settings.passage_max_len, fmt=phantom_rag.grit_format())
        embed_docs = grit.embed
        embed_queries = lambda x: grit.embed(x, instruction=settings.grit_instruction)  # noqa: E731
    docs = [p["text"] for p in data.eval_passages]
    ranked, recall = retrieval_eval(args.retriever, embed_docs, embed_queries, docs,
                                    [q["question"] for q in questions], [q["gold"] for q in questions],
                                    [q["hops"] for q in questions], (1, k, 5), settings.retrieval.scann, k + 1)
    rag_example = phantom_rag.rag_example
    prompts = {
        "no retrieval": [rag_example(tokenizer, q["question"], []).blocks for q in questions],
        "retrieval": [rag_example(tokenizer, q["question"], [docs[j] for j in r[:k] if j >= 0]).blocks
                      for q, r in zip(questions, ranked)],
        "gold": [rag_example(tokenizer, q["question"], [docs[j] for j in with_gold(r, q["gold"], k)]).blocks
                 for q, r in zip(questions, ranked)],
    }
    ba = BlockAttention(model, store=KVStore(max_bytes=1 << 30))
    plan = (("no retrieval", "no retrieval", "full"),
            (f"retrieved top-{k} ({args.retriever}), full", "retrieval", "full"),
            (f"retrieved top-{k} ({args.retriever}), block", "retrieval", "block"),
            (f"gold in top-{k}, block", "gold", "block"))
    results, examples = _answer_conditions(plan, prompts, [q["answer"] for q in questions], True, tokenizer, ba, args)
    info = {"dataset": str(args.data), "questions": len(questions), "question_kind": data.question_kind,
            "split": args.split, "retrieval": {kk: v for kk, v in recall.items() if kk != "by_hops"},
            "kv_store": {"entries": len(ba.store), **ba.store.stats}}
    return {"info": info, "results": results}, examples


def eval_nq(args, max_seq_len: int, model, tokenizer) -> tuple[dict, list[dict]]:
    examples = load_nq_oracle(args.data, limit=args.limit or None)
    ba = BlockAttention(model, store=KVStore(max_bytes=1 << 30))
    max_len = max_seq_len - args.max_new_tokens - 2 * ba.pad_multiple  # the cache and the last block are padded
    closed, oracle = [], []
    for ex in examples:
        last = encode(tokenizer, phantom_rag.question_block(ex.question))
        closed.append([last])
        oracle.append(_fit([encode(tokenizer, phantom_rag.passage_text(ex.gold.title, ex.gold.text)), last], max_len))
    plan = (("no context", "closed", "full"), ("gold passage, full", "oracle", "full"),
            ("gold passage, block", "oracle", "block"))
    results, shown = _answer_conditions(plan, {"closed": closed, "oracle": oracle},
                                        [list(ex.answers) for ex in examples], False, tokenizer, ba, args)
    info = {"dataset": str(args.data), "questions": len(examples)}
    return {"info": info, "results": results}, shown


def print_table(report: dict) -> None:
    info = report["info"]
    print(f"# {info['dataset']}: {info['questions']} questions"
          + (f" ({info['question_kind']}, {info['split']})" if "split" in info else ""))
    if "retrieval" in info:
        print("# retrieval: " + ", ".join(f"{k}={v:.3f}" for k, v in info["retrieval"].items()
                                          if k.startswith(("recall", "hit"))))
    print(table(["condition", *METRICS, "seconds"],
                [[name, *(r[m] for m in METRICS), r["seconds"]] for name, r in report["results"].items()],
                floatfmt=(".3f",) * (len(METRICS) + 1) + (".1f",)))


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval rag_qa", description=__doc__)
    p.add_argument("--model", "--checkpoint", dest="model", required=True, type=input_dir,
                   help="a run folder (rag-jax demo / rag-jax train output) or an HF folder with tokenizer.json")
    p.add_argument("--data", required=True, type=input_path,
                   help="PhantomWiki folder, or an NQ-open oracle .jsonl(.gz) file")
    p.add_argument("--limit", type=integer(0), default=200, help="at most this many questions (0 = all)")
    p.add_argument("--split", choices=("heldout", "all"), default="heldout",
                   help="PhantomWiki: the demo's held-out questions, or all selected ones")
    p.add_argument("--questions", choices=phantom_rag.QUESTION_KINDS, default=None,
                   help="PhantomWiki question selection (default: the run's task.questions)")
    p.add_argument("--max-hops", type=integer(1), default=None, help="PhantomWiki: at most this many hops")
    p.add_argument("--retriever", choices=("grit", "minilm"), default=None,
                   help="PhantomWiki retriever (default: the run's retrieval.retriever)")
    p.add_argument("--max-new-tokens", type=integer(1), default=32)
    p.add_argument("--batch-size", type=integer(1), default=64)
    p.add_argument("--out", type=output_file, default=None,
                   help="JSON output (default: runs/eval/rag_qa_<data>.json)")
    args = p.parse_args(argv)
    try:
        loaded, settings = load_rag_model(args.model)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    args.retriever = args.retriever or settings.retrieval.retriever
    timer = StageTimer()
    if args.data.is_dir():
        report, examples = eval_phantomwiki(args, settings, loaded.model, loaded.tokenizer)
    else:
        report, examples = eval_nq(args, loaded.config.max_seq_len, loaded.model, loaded.tokenizer)
    report["info"].update(model=str(args.model), seconds=timer.total()[0], examples=examples)
    print_table(report)
    out = args.out or Path("runs/eval") / f"rag_qa_{args.data.name.split('.')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, json.dumps(report, indent=1))
    print(f"# wrote {out}")
    return 0
