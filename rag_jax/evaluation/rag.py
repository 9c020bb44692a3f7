"""Shared RAG evaluation: answer scores, retrieval recall through a ScaNN index (or BM25), prompt passage order,
batched greedy answers under full or Block-Attention, and the TTFT curve (full prefill vs cached passage blocks).

Used by ``rag-jax demo`` and the evaluation scripts (``rag-jax eval rag_qa``, ``retrieval_recall``, ...);
metric definitions are in ``rag_jax.metrics``.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from rag_jax import metrics
from rag_jax.atomic import write_text
from rag_jax.data.block_rag import encode
from rag_jax.data.phantom_rag import answer_text, question_block
from rag_jax.evaluation.timing import median_ms
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.progress import progress_bar
from rag_jax.retrieval.embedders import BertEmbedder
from rag_jax.retrieval.lexical import BM25Index
from rag_jax.retrieval.pipeline import Retriever
from rag_jax.retrieval.scann_index import ScannConfig, ScannIndex
from rag_jax.tokenizer import EOS, eos_tuple

RETRIEVERS = ("grit", "minilm", "bm25")


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """The retrieval section of a RAG run (``rag-jax demo`` config, read back by the evaluation scripts).

    Attributes:
      retriever: the index that feeds the answering prompts: ``grit`` (the trained model), ``minilm`` (dense,
        pretrained) or ``bm25`` (lexical, ``rag_jax.retrieval.lexical``); all available ones are reported.
      ks: cut-offs of the reported recall@k / hit@k.
      scann: ScaNN index parameters (``auto`` picks brute force below 20K passages).
    """

    retriever: str = "minilm"
    ks: tuple[int, ...] = (1, 2, 5, 10)
    scann: ScannConfig = dataclasses.field(default_factory=ScannConfig)

    def __post_init__(self):
        if self.retriever not in RETRIEVERS:
            raise ValueError(f"retrieval.retriever={self.retriever!r}; valid: {RETRIEVERS}")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"retrieval.ks={self.ks!r} must be a non-empty list of ints >= 1")


def score_answer(prediction: str, golds: Sequence[str], *, golds_are_set: bool = True) -> dict[str, float]:
    """EM / F1 / best-subspan EM (SQuAD-normalized, ``rag_jax.metrics``) and PhantomWiki set EM / set-F1.

    ``golds_are_set``: PhantomWiki answer sets (SQuAD metrics against the comma-joined set; set metrics
    against the set) or alternatives as in NQ (every metric = the best over the alternatives).
    """
    if golds_are_set:
        joined = answer_text(golds)
        s = metrics.phantom_set_metrics(prediction, list(golds))
        return {"em": metrics.exact_match(prediction, joined), "f1": metrics.f1_score(prediction, joined),
                "subspan_em": metrics.best_subspan_em(prediction, joined), "set_em": s["em"], "set_f1": s["f1"]}
    sets = [metrics.phantom_set_metrics(prediction, [g]) for g in golds]
    return {"em": metrics.exact_match(prediction, golds), "f1": metrics.f1_score(prediction, golds),
            "subspan_em": metrics.best_subspan_em(prediction, golds),
            "set_em": max(s["em"] for s in sets), "set_f1": max(s["f1"] for s in sets)}


def answer_recall(prediction: str, golds: Sequence[str]) -> float:
    """Fraction of the gold answers that occur (SQuAD-normalized) in ``prediction``."""
    return sum(metrics.best_subspan_em(prediction, g) for g in golds) / len(golds)


def passage_search(name: str, docs: Sequence[str]):
    """``(queries, k) -> ids [q][k]`` best first over ``docs``: ``bm25`` (``rag_jax.retrieval.lexical``) or
    ``minilm`` (MiniLM-L6 embeddings, exact dot-product search over the few hundred passages of a universe).
    Raises ValueError for another name."""
    if name == "bm25":
        index = BM25Index(list(docs))
        return lambda queries, k: index.search(list(queries), k)[1].tolist()
    if name != "minilm":
        raise ValueError(f"retriever {name!r}; valid: bm25, minilm")
    emb = BertEmbedder()
    vectors = emb.embed(list(docs))
    return lambda queries, k: np.argsort(-(emb.embed(list(queries)) @ vectors.T), axis=1, kind="stable")[:, :k].tolist()


def mean_scores(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}


def per_question(questions: Sequence[dict], predictions: dict[str, list[str]],
                 scores: dict[str, list[dict[str, float]]]) -> list[dict]:
    """One record per question (``question``, ``gold`` = its ``answer``, and per condition ``{"prediction",
    **scores}``): the report's ``qa.answers``, for paired comparisons between conditions."""
    return [{"question": q["question"], "gold": q["answer"],
             **{c: {"prediction": predictions[c][i], **scores[c][i]} for c in predictions}}
            for i, q in enumerate(questions)]


def retrieval_eval(name: str, embed_docs, embed_queries, docs: Sequence[str], queries: Sequence[str],
                   gold: Sequence[Sequence[int]], hops: Sequence[int], ks: Sequence[int], scann: ScannConfig,
                   depth: int) -> tuple[np.ndarray, dict]:
    """Embed ``docs`` into a ScaNN index, search every query, score against its gold doc indices.

    Args:
      embed_docs / embed_queries: ``texts -> float32 [n, dim]`` unit-norm (the Embedder protocol).
      gold: per query, the indices of its relevant docs; hops: per query, for the per-hop breakdown.
      depth: results kept per query (>= max(ks)).

    Returns:
      ``(ranked doc indices int64 [q, depth'] (-1 = none), {"recall@k", "hit@k", "by_hops": {hops: {...}},
      "seconds", "num_docs", "retriever", "index"})``.
    """
    t0 = time.perf_counter()
    retriever = Retriever.from_texts(docs, embed_docs, embed_queries, lambda dim: ScannIndex(dim, scann))
    _, ranked = retriever.search_ids(queries, max(depth, *ks))
    result = ranked_metrics(ranked, gold, hops, ks)
    result.update(seconds=time.perf_counter() - t0, num_docs=len(docs), retriever=name,
                  index=dict(retriever.index.params))
    return ranked, result


def bm25_eval(docs: Sequence[str], queries: Sequence[str], gold: Sequence[Sequence[int]], hops: Sequence[int],
              ks: Sequence[int], depth: int) -> tuple[np.ndarray, dict]:
    """``retrieval_eval`` with a BM25 index (``rag_jax.retrieval.lexical``) instead of embeddings + ScaNN."""
    t0 = time.perf_counter()
    index = BM25Index(list(docs))
    _, ranked = index.search(list(queries), max(depth, *ks))
    result = ranked_metrics(ranked, gold, hops, ks)
    result.update(seconds=time.perf_counter() - t0, num_docs=len(docs), retriever="BM25 (lexical)",
                  index={"kind": "bm25", "k1": index.k1, "b": index.b})
    return ranked, result


def ranked_metrics(ranked, gold: Sequence[Sequence[int]], hops: Sequence[int], ks: Sequence[int]) -> dict:
    """recall@k / hit@k of ``ranked`` doc indices ``[q, depth]`` against ``gold``, overall and ``by_hops``."""
    def scores(sel):
        r, g = [ranked[i] for i in sel], [gold[i] for i in sel]
        out = {}
        for k in ks:
            out[f"recall@{k}"] = metrics.recall_at_k(r, g, k)
            out[f"hit@{k}"] = metrics.hit_at_k(r, g, k)
        out["num_questions"] = len(sel)
        return out

    result = scores(range(len(gold)))
    result["by_hops"] = {h: scores([i for i, x in enumerate(hops) if x == h]) for h in sorted(set(hops))}
    return result


def generate_answers(block_attention, tokenizer, prompts: Sequence[Sequence[Sequence[int]]], *, mode: str,
                     max_new_tokens: int, batch_size: int, eos_id: int | Sequence[int] | None = None) -> list[str]:
    """Greedy answers (text up to the first end id) for block prompts via ``BlockAttention.generate``, in input
    order; prompts of similar length are batched together (less padding, fewer compiled widths).

    ``eos_id``: the id(s) that end an answer; default the demo tokenizer's ``<eos>``.
    """
    eos = eos_tuple(tokenizer.token_to_id(EOS) if eos_id is None else eos_id)
    order = np.argsort([sum(map(len, b)) for b in prompts], kind="stable")
    rows = [None] * len(prompts)
    for i in range(0, len(prompts), batch_size):
        batch = order[i:i + batch_size]
        out = block_attention.generate([prompts[j] for j in batch], max_new_tokens=max_new_tokens, mode=mode,
                                       eos_id=eos)
        for j, r in zip(batch, np.asarray(out).tolist()):
            rows[j] = r
    cut = [next((j for j, t in enumerate(r) if t in eos), len(r)) for r in rows]
    return [tokenizer.decode(r[:n], skip_special_tokens=True).strip() for r, n in zip(rows, cut)]


def greedy_replies(loaded, model, prompts: Sequence[Sequence[Sequence[int]]], *, max_new_tokens: int,
                   batch_size: int) -> list[str]:
    """Greedy full-attention replies of ``model`` (with ``loaded``'s tokenizer and end-of-turn ids) to chat prompts
    given as blocks of token ids (``rag_jax.data.chat_blocks.ChatBlocks.blocks``), in input order."""
    return generate_answers(BlockAttention(model), loaded.tokenizer, prompts, mode="full",
                            max_new_tokens=max_new_tokens, batch_size=batch_size, eos_id=loaded.eos_ids)


def complete_replies(tokenizer, replies: Sequence[str], max_new_tokens: int) -> list[bool]:
    """Per greedy reply: True when it ended before the ``max_new_tokens`` cap (its re-encoded text is shorter),
    False when generation was cut there. A cut reply used as a training target is followed by the end-of-turn
    token in the training row, which teaches the model to stop mid-sentence."""
    return [len(tokenizer.encode(r, add_special_tokens=False).ids) < max_new_tokens for r in replies]


def memo_json(path, keys: Sequence[str], compute, chunk: int | None = None) -> list:
    """``compute(missing keys) -> values`` for the ``keys`` not yet in the JSON object at ``path`` (None: no file,
    compute all), stored there (written atomically) so a rerun does not recompute them; the values of ``keys``
    in order. ``chunk``: compute at most this many keys per call and store after each, so a long run cut short
    keeps what it finished (None: one call).

    Raises:
      ValueError: ``chunk`` below 1.
    """
    import json
    from pathlib import Path

    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk={chunk}; valid: None or an integer >= 1")
    if path is None:
        return list(compute(list(keys)))
    path = Path(path)
    cache = json.loads(path.read_text()) if path.is_file() else {}
    todo = list(dict.fromkeys(k for k in keys if k not in cache))
    step = chunk or max(1, len(todo))
    for start in range(0, len(todo), step):
        part = todo[start:start + step]
        cache.update(zip(part, compute(part)))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(cache, indent=0))
    return [cache[k] for k in keys]



def ttft_curve(block_attention, tokenizer, passages: Sequence[str], question: str, sizes: Sequence[int],
               repeats: int, progress: bool = False, last: Sequence[int] | None = None) -> list[dict]:
    """TTFT (ms, median) of one prompt with ``n`` passages for each ``n`` in ``sizes``: a full causal
    prefill vs Block-Attention prefill of the question block over warm passage caches (both up to the
    first token's logits). Sizes whose prompt exceeds ``max_seq_len`` (or the passages given) are skipped.
    ``last``: the question block's ids (default: the demo's ``question_block(question)``)."""
    import jax

    last = list(last) if last is not None else encode(tokenizer, question_block(question))
    rows = []
    for n in progress_bar(sizes, enabled=progress, desc="TTFT full vs cached", unit="size"):
        if n > len(passages):
            continue
        blocks = [encode(tokenizer, p) for p in passages[:n]] + [last]
        total = sum(len(b) for b in blocks)
        if total + 1 > block_attention.config.max_seq_len:
            continue
        full = median_ms(lambda: jax.block_until_ready(block_attention.prefill(blocks, mode="full").logits), repeats)
        cached = median_ms(lambda: jax.block_until_ready(block_attention.prefill(blocks, mode="block").logits),
                            repeats)
        rows.append({"passages": n, "prompt_tokens": total, "prefilled_tokens_cached": len(last),
                     "full_ms": full, "cached_ms": cached, "speedup": full / cached})
    return rows



PASSAGE_ORDERS = ("rank", "reverse")


def with_gold(ranked: Sequence[int], gold: Sequence[int], k: int) -> list[int]:
    """The top-k of a retriever that ranks the gold passages first: ``gold[:k]`` (repeats dropped), then the best
    retrieved others (best first, as ``ranked``); ``prompt_order(..., "reverse")`` puts the gold ones last."""
    gold = [int(g) for g in dict.fromkeys(gold)][:k]
    return gold + [int(i) for i in ranked if i >= 0 and i not in gold][:k - len(gold)]


def prompt_order(passages: Sequence, order: str) -> list:
    """``passages`` (best first) in prompt order: ``rank`` keeps them; ``reverse`` puts the best one last, next to
    the question, where a small reader uses a passage best (Lost in the Middle, Liu et al. TACL 2024, Fig. 5:
    accuracy is highest for evidence at either end of the context; SmolLM2-135M on PhantomWiki favours the
    end). Raises ValueError for another ``order``."""
    if order not in PASSAGE_ORDERS:
        raise ValueError(f"passage order {order!r}; valid: {', '.join(PASSAGE_ORDERS)}")
    return list(passages)[::-1] if order == "reverse" else list(passages)


def prompt_passages(ranked: Sequence[int], gold: Sequence[int], k: int, order: str) -> dict[str, list[int]]:
    """One question's passage indices in prompt order (``prompt_order``) for the demo's conditions:
    ``retrieval`` (the top ``k`` of ``ranked``, ``-1`` skipped) and ``oracle`` (``with_gold``)."""
    top = [int(j) for j in ranked[:k] if j >= 0]
    return {"retrieval": prompt_order(top, order), "oracle": prompt_order(with_gold(ranked, gold, k), order)}
