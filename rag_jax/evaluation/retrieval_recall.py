"""Retrieval recall@k on a PhantomWiki folder: pretrained MiniLM vs a demo checkpoint in GRIT embedding mode.

Articles are cut into section passages as in ``rag-jax demo`` (``rag_jax.demo.split_article``:
``# Name`` + one ``## Family`` / ``## Friends`` / ``## Attributes`` section each) and embedded into a
ScaNN index (``rag_jax.retrieval.scann_index``, size rules: brute force below 20K passages;
``--exact`` adds the exact JAX index as a cross-check); each question (as is for MiniLM, with the
checkpoint's instruction for GRIT) retrieves its top k. Gold passages = the sections of the evidence
articles (``titles``, or derived from the Prolog query by ``rag_jax.data.loaders``) that state the
query's predicates (``rag_jax.demo.select_questions``). Reported per embedder and per hop count:
recall@k = mean fraction of gold passages in the top k; hit@k = any gold passage in the top k
(``rag_jax.metrics``). NQ retrieval (MiniLM, exact vs ScaNN) is ``eval/retrieval_nq.py``.

    python eval/retrieval_recall.py --data ../shared/data/phantomwiki/depth6_seed11 --checkpoint runs/demo/checkpoint
    python eval/retrieval_recall.py --data ../shared/data/phantomwiki/depth10_seed1        # MiniLM only
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rag_jax import demo  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, type=Path, help="PhantomWiki folder (articles.json + questions.json)")
    p.add_argument("--checkpoint", type=Path, default=None, help="demo checkpoint folder; adds the GRIT rows")
    p.add_argument("--no-minilm", action="store_true", help="skip the pretrained MiniLM rows")
    p.add_argument("--ks", default="1,2,5,10", help="cut-offs, comma-separated")
    p.add_argument("--questions", choices=demo.QUESTION_KINDS[1:], default="all",
                   help="question selection (demo task kinds; default: every question with gold titles)")
    p.add_argument("--max-hops", type=int, default=100, help="keep questions with at most this many hops")
    p.add_argument("--exact", action="store_true", help="also search with the exact index (agreement check)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default: runs/eval/retrieval_recall_<data>.json)")
    args = p.parse_args(argv)
    try:
        ks = tuple(int(k) for k in args.ks.split(","))
    except ValueError:
        p.error(f"--ks {args.ks!r} must be comma-separated integers")
    if min(ks) < 1:
        p.error("--ks values must be >= 1")
    if args.no_minilm and args.checkpoint is None:
        p.error("nothing to evaluate: --no-minilm without --checkpoint")
    from rag_jax.data.loaders import load_phantomwiki
    try:
        data = load_phantomwiki(args.data)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    articles, questions = demo.as_dicts(data.articles, data.questions)
    passages = demo.article_passages(articles)
    questions = demo.select_questions(questions, passages, args.questions, args.max_hops, num_passages=10**6)
    if not questions:
        p.error(f"no question of kind {args.questions!r} with <= {args.max_hops} hops has gold titles")

    embedders = {}
    scann = demo.RetrievalConfig().scann
    if not args.no_minilm:
        from rag_jax.retrieval.embedders import BertEmbedder
        minilm = BertEmbedder()
        embedders["MiniLM-L6 (pretrained)"] = (minilm.embed, minilm.embed)
    if args.checkpoint is not None:
        from rag_jax.model.embedding import GritEmbedder
        try:
            cfg, graphdef, params, tokenizer = demo.load_checkpoint(args.checkpoint)
        except (FileNotFoundError, ValueError) as e:
            p.error(str(e))
        grit = GritEmbedder((graphdef, params), tokenizer, max_length=cfg.train.passage_max_len or 256,
                            fmt=demo.grit_format())
        embedders[f"GRIT ({args.checkpoint})"] = (
            grit.embed, lambda x: grit.embed(x, instruction=cfg.train.grit_instruction))
        scann = cfg.retrieval.scann

    report = {"dataset": str(args.data), "articles": len(articles), "passages": len(passages),
              "questions": len(questions), "question_kind": args.questions, "ks": list(ks), "results": {}}
    texts = [p["text"] for p in passages]
    q_texts = [q["question"] for q in questions]
    for name, (embed_docs, embed_queries) in embedders.items():
        ranked, res = demo.retrieval_eval(name, embed_docs, embed_queries, texts, q_texts,
                                          [q["gold"] for q in questions], [q["hops"] for q in questions], ks, scann,
                                          max(ks))
        if args.exact:
            from rag_jax.retrieval.exact import ExactIndex
            d = embed_docs(texts)
            index = ExactIndex(d.shape[1])
            index.add(d, np.arange(len(d)))
            _, exact = index.search(embed_queries(q_texts), max(ks))
            res["agree_with_exact"] = float(np.mean([len(set(a[:max(ks)]) & set(b)) / len(b)
                                                     for a, b in zip(ranked, exact)]))
        report["results"][name] = res

    print(f"# {args.data}: {len(articles)} articles -> {len(passages)} section passages, {len(questions)} questions "
          f"({args.questions}, <= {args.max_hops} hops); index: ScaNN")
    cols = [f"recall@{k}" for k in ks] + [f"hit@{k}" for k in ks]
    print("| embedder | hops | questions | " + " | ".join(cols) + " | seconds |")
    print("|---|---:|---:|" + "---:|" * (len(cols) + 1))
    for name, res in report["results"].items():
        rows = [("all", res)] + [(str(h), r) for h, r in res["by_hops"].items()]
        for hops, r in rows:
            secs = f"{res['seconds']:.1f}" if hops == "all" else ""
            print(f"| {name} | {hops} | {r['num_questions']} | " + " | ".join(f"{r[c]:.3f}" for c in cols)
                  + f" | {secs} |")
        if "agree_with_exact" in res:
            print(f"# {name}: top-{max(ks)} agreement of ScaNN with the exact index: {res['agree_with_exact']:.4f}")
    out = args.out or Path("runs/eval") / f"retrieval_recall_{args.data.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"# wrote {out}")
    return report


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"# total {time.perf_counter() - t0:.1f} s")
