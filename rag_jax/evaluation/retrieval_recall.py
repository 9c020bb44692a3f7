"""Retrieval recall@k on a PhantomWiki folder: pretrained MiniLM vs a model (``--model``) in GRIT embedding mode.

Articles are cut into section passages as in ``rag-jax demo`` (``rag_jax.data.phantom_rag.split_article``:
``# Name`` + one ``## Family`` / ``## Friends`` / ``## Attributes`` section each) and embedded into a
ScaNN index (``rag_jax.retrieval.scann_index``, size rules: brute force below 20K passages;
``--exact`` adds the exact JAX index as a cross-check); each question (as is for MiniLM, with the
run's instruction for GRIT) retrieves its top k. Gold passages = the sections of the evidence
articles (``titles``, or derived from the Prolog query by ``rag_jax.data.loaders``) that state the
query's predicates (``rag_jax.data.phantom_rag.select_questions``). Reported per embedder and per hop count:
recall@k = mean fraction of gold passages in the top k; hit@k = any gold passage in the top k
(``rag_jax.metrics``). NQ retrieval (MiniLM, exact vs ScaNN) is ``rag-jax eval retrieval_nq``.

    rag-jax eval retrieval_recall --data ../shared/data/phantomwiki/depth6_seed11 --model runs/demo
    rag-jax eval retrieval_recall --data ../shared/data/phantomwiki/depth10_seed1        # MiniLM only
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rag_jax.atomic import write_text
from rag_jax.data import phantom_rag
from rag_jax.data.loaders import load_phantomwiki
from rag_jax.args import ScriptParser, input_dir, int_list, integer, output_file
from rag_jax.evaluation.models import load_rag_model, rag_settings
from rag_jax.evaluation.rag import retrieval_eval
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer
from rag_jax.metrics import recall_at_k
from rag_jax.model.embedding import GritEmbedder
from rag_jax.retrieval.embedders import BertEmbedder
from rag_jax.retrieval.exact import ExactIndex


def main(argv=None) -> int:
    timer = StageTimer()
    p = ScriptParser(prog="rag-jax eval retrieval_recall", description=__doc__)
    p.add_argument("--data", required=True, type=input_dir, help="PhantomWiki folder (articles.json + questions.json)")
    p.add_argument("--model", "--checkpoint", dest="model", type=input_dir, default=None,
                   help="run folder (rag-jax demo output) or HF folder with tokenizer.json; adds the GRIT rows")
    p.add_argument("--no-minilm", action="store_true", help="skip the pretrained MiniLM rows")
    p.add_argument("--ks", type=int_list(1), default="1,2,5,10", help="cut-offs, comma-separated")
    p.add_argument("--questions", choices=phantom_rag.QUESTION_KINDS[1:], default="all",
                   help="question selection (demo task kinds; default: every question with gold titles)")
    p.add_argument("--max-hops", type=integer(1), default=100, help="keep questions with at most this many hops")
    p.add_argument("--exact", action="store_true", help="also search with the exact index (agreement check)")
    p.add_argument("--out", type=output_file, default=None,
                   help="JSON output (default: runs/eval/retrieval_recall_<data>.json)")
    args = p.parse_args(argv)
    ks = tuple(args.ks)
    if args.no_minilm and args.model is None:
        p.error("nothing to evaluate: --no-minilm without --model")
    try:
        data = load_phantomwiki(args.data)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    articles, questions = phantom_rag.as_dicts(data.articles, data.questions)
    passages = phantom_rag.article_passages(articles)
    questions = phantom_rag.select_questions(questions, passages, args.questions, args.max_hops, num_passages=10**6)
    if not questions:
        p.error(f"no question of kind {args.questions!r} with <= {args.max_hops} hops has gold titles")

    embedders = {}
    scann = rag_settings({}).retrieval.scann
    if not args.no_minilm:
        minilm = BertEmbedder()
        embedders["MiniLM-L6 (pretrained)"] = (minilm.embed, minilm.embed)
    if args.model is not None:
        try:
            loaded, settings = load_rag_model(args.model)
        except (FileNotFoundError, ValueError) as e:
            p.error(str(e))
        grit = GritEmbedder(loaded.model, loaded.tokenizer, max_length=settings.passage_max_len,
                            fmt=phantom_rag.grit_format())
        embedders[f"GRIT ({args.model})"] = (grit.embed, lambda x: grit.embed(x, instruction=settings.grit_instruction))
        scann = settings.retrieval.scann

    report = {"dataset": str(args.data), "articles": len(articles), "passages": len(passages),
              "questions": len(questions), "question_kind": args.questions, "ks": list(ks), "results": {}}
    texts = [p["text"] for p in passages]
    q_texts = [q["question"] for q in questions]
    for name, (embed_docs, embed_queries) in embedders.items():
        ranked, res = retrieval_eval(name, embed_docs, embed_queries, texts, q_texts,
                                     [q["gold"] for q in questions], [q["hops"] for q in questions], ks, scann,
                                     max(ks))
        if args.exact:
            d = embed_docs(texts)
            index = ExactIndex(d.shape[1])
            index.add(d, np.arange(len(d)))
            _, exact = index.search(embed_queries(q_texts), max(ks))
            res["agree_with_exact"] = recall_at_k(ranked, exact, max(ks))
        report["results"][name] = res

    print(f"# {args.data}: {len(articles)} articles -> {len(passages)} section passages, {len(questions)} questions "
          f"({args.questions}, <= {args.max_hops} hops); index: ScaNN")
    cols = [f"recall@{k}" for k in ks] + [f"hit@{k}" for k in ks]
    rows = []
    for name, res in report["results"].items():
        for hops, r in [("all", res)] + [(str(h), r) for h, r in res["by_hops"].items()]:
            rows.append([name, hops, r["num_questions"], *(r[c] for c in cols),
                         res["seconds"] if hops == "all" else ""])
    print(table(["embedder", "hops", "questions", *cols, "seconds"], rows,
                floatfmt=(".3f",) * (3 + len(cols)) + (".1f",)))
    for name, res in report["results"].items():
        if "agree_with_exact" in res:
            print(f"# {name}: top-{max(ks)} agreement of ScaNN with the exact index: {res['agree_with_exact']:.4f}")
    out = args.out or Path("runs/eval") / f"retrieval_recall_{args.data.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, json.dumps(report, indent=1, default=str))
    print(f"# wrote {out}; total {timer.total()[0]:.1f} s")
    return 0
