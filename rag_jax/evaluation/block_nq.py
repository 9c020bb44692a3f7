"""Block-Attention on a pretrained chat model without fine-tuning, NQ-open: full vs block inference by gold position.

Block-Attention (Ma, Wang, Lan, ICLR 2025, Table 1 "w/o block fine-tuning") reports that a model used in
block mode without block fine-tuning loses accuracy; this script measures that drop (issue 17, item 1, the
first two rows) in the Lost in the Middle setting (Liu et al., TACL 2024):

- data: ``nq-open-oracle.jsonl.gz``; a fixed, seeded held-out split of the questions (``--heldout``);
- contexts: each question's gold passage plus ``--num-passages - 1`` hard negatives, the passages of the pool
  of all gold passages (``nq_passage_pool``) nearest to the question under MiniLM (exact search), skipping its
  own gold passage and any passage that contains an answer; the gold passage is put at each of ``--positions``;
- prompt: the model's chat template, one block per passage (``rag_jax.demo.real_model.ChatBlocks``);
- answers: greedy; score = best-subspan EM (an answer occurs in the reply, as Lost in the Middle).

    rag-jax eval block_nq --limit 50                     # SmolLM2-135M-Instruct, gold at 0 / 4 / 9
    rag-jax eval block_nq --limit 10 --positions 0,9     # quick run
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence

import numpy as np

from rag_jax.data.loaders import NQ_ORACLE, load_nq_oracle, nq_passage_pool, shared_file
from rag_jax.evaluation.args import ScriptParser, input_file, int_list, integer, model_source, output_file, real
from rag_jax.evaluation.tables import table


def heldout_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held-out)`` question indices: a seeded permutation's first ``round(n * fraction)`` are held out
    (each list sorted). Raises ValueError unless ``0 < fraction < 1``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout fraction={fraction} must be in (0, 1)")
    perm = np.random.default_rng(seed).permutation(n)
    k = max(1, round(n * fraction))
    return sorted(perm[k:].tolist()), sorted(perm[:k].tolist())


def hard_negatives(ranked: Sequence[int], gold: int, k: int, skip: Sequence[int] = ()) -> list[int]:
    """The first ``k`` pool indices of ``ranked`` that are neither ``gold`` nor in ``skip``.

    Raises ValueError when fewer than ``k`` remain (search deeper)."""
    skip = set(skip)
    out = [int(i) for i in ranked if i != gold and i not in skip][:k]
    if len(out) < k:
        raise ValueError(f"only {len(out)} hard negatives in the {len(ranked)} ranked passages, {k} needed; "
                         "search deeper")
    return out


def place(negatives: Sequence[int], gold: int, position: int) -> list[int]:
    """``negatives`` with ``gold`` inserted at ``position`` (0 = first). Raises ValueError if out of range."""
    if not 0 <= position <= len(negatives):
        raise ValueError(f"position={position} must be in [0, {len(negatives)}]")
    return [*negatives[:position], gold, *negatives[position:]]


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval block_nq", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct",
                   help="embedded name, .gguf file or HF folder")
    p.add_argument("--data", type=input_file, default=str(shared_file(*NQ_ORACLE)))
    p.add_argument("--limit", type=integer(1), default=50, help="held-out questions evaluated (the first ones)")
    p.add_argument("--heldout", type=real(0, 1, lo_open=True, hi_open=True), default=0.2,
                   help="fraction of the questions held out")
    p.add_argument("--seed", type=integer(0), default=0, help="split seed")
    p.add_argument("--num-passages", type=integer(1), default=10)
    p.add_argument("--positions", type=int_list(0), default="0,4,9", help="gold positions (0-based), comma-separated")
    p.add_argument("--max-new-tokens", type=integer(1), default=24)
    p.add_argument("--batch-size", type=integer(1), default=16)
    p.add_argument("--cache", type=output_file, default=None, help="npz to reuse/store the MiniLM pool embeddings")
    p.add_argument("--out", type=output_file, default=None, help="JSON output")
    args = p.parse_args(argv)
    positions = args.positions
    if any(x >= args.num_passages for x in positions):
        p.error(f"argument --positions: {positions} must lie in [0, --num-passages={args.num_passages})")

    from rag_jax.demo.real_model import ChatBlocks
    from rag_jax.evaluation.rag import generate_answers, score_answer
    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.metrics import best_subspan_em
    from rag_jax.model.load import load_model
    from rag_jax.retrieval.embedders import BertEmbedder, embed_texts
    from rag_jax.retrieval.exact import ExactIndex

    examples = load_nq_oracle(args.data)
    pool, gold_ids = nq_passage_pool(examples)
    _, heldout = heldout_split(len(examples), args.heldout, args.seed)
    heldout = heldout[:args.limit]
    texts = [f"(Title: {x.title}) {x.text}" for x in pool]
    emb = BertEmbedder()
    if args.cache is not None and args.cache.is_file():
        p_vecs = np.load(args.cache)["passages"]
    else:
        p_vecs = embed_texts(emb, [f"{x.title}\n{x.text}" for x in pool], desc="MiniLM pool")
        if args.cache is not None:
            np.savez(args.cache, passages=p_vecs)
    index = ExactIndex(p_vecs.shape[1])
    index.add(p_vecs, np.arange(len(pool)))
    depth = args.num_passages + 40
    _, ranked = index.search(emb.embed([examples[i].question for i in heldout]), depth)
    negatives = []
    for row, i in zip(ranked, heldout):
        with_answer = [int(j) for j in row if best_subspan_em(pool[j].text, examples[i].answers)]
        negatives.append(hard_negatives(row, gold_ids[i], args.num_passages - 1, with_answer))

    loaded = load_model(args.model)
    chat = ChatBlocks(loaded)
    ba = BlockAttention(loaded.model, fingerprint=str(loaded.source))
    results = {}
    for mode in ("full", "block"):
        for pos in positions:
            prompts = [chat.blocks(examples[i].question, [texts[j] for j in place(neg, gold_ids[i], pos)])
                       for neg, i in zip(negatives, heldout)]
            t0 = time.perf_counter()
            preds = generate_answers(ba, loaded.tokenizer, prompts, mode=mode, max_new_tokens=args.max_new_tokens,
                                     batch_size=args.batch_size, eos_id=loaded.eos_ids)
            em = [score_answer(pr, examples[i].answers, golds_are_set=False)["subspan_em"]
                  for pr, i in zip(preds, heldout)]
            results[f"{mode}@{pos}"] = {"subspan_em": float(np.mean(em)), "seconds": time.perf_counter() - t0,
                                        "prompt_tokens": float(np.mean([sum(map(len, b)) for b in prompts]))}
            print(f"  {mode} attention, gold at {pos}: best-subspan EM {np.mean(em):.3f}", flush=True)
    rows = [[mode, *[results[f"{mode}@{x}"]["subspan_em"] for x in positions],
             np.mean([results[f"{mode}@{x}"]["subspan_em"] for x in positions])] for mode in ("full", "block")]
    print(f"# {args.model}, NQ-open held-out: {len(heldout)} questions, {args.num_passages} passages (gold + MiniLM "
          f"hard negatives from {len(pool)} gold passages); best-subspan EM; no fine-tuning")
    print(table(["inference", *[f"gold@{x}" for x in positions], "mean"], rows))
    if args.out is not None:
        from rag_jax.atomic import write_text
        write_text(args.out, json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "questions": len(heldout), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
