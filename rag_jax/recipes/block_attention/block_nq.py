"""Block-Attention on a pretrained chat model, NQ-open: full vs block inference by gold position, before and after
Block-Attention fine-tuning (issue 17, item 1).

Block-Attention (Ma, Wang, Lan, ICLR 2025, Table 1 "w/o block fine-tuning") reports that a model used in
block mode without block fine-tuning loses accuracy and that block fine-tuning (every sample in full and in
block mode, §2.4) brings it back near full attention. This script measures both in the Lost in the Middle
setting (Liu et al., TACL 2024):

- data: ``nq-open-oracle.jsonl.gz``; a fixed, seeded train / held-out split of the questions (``--heldout``);
- contexts: each question's gold passage plus ``--num-passages - 1`` hard negatives, the passages of the pool
  of all gold passages (``nq_passage_pool``) nearest to the question under MiniLM (exact search), skipping its
  own gold passage and any passage that contains an answer; the gold passage is put at each of ``--positions``;
- prompt: the model's chat template, one block per passage (``rag_jax.data.chat_blocks.ChatBlocks``);
- answers: greedy; score = best-subspan EM (an answer occurs in the reply, as Lost in the Middle);
- fine-tuning (``--finetune-steps``, ``rag_jax.train.finetune``): training questions with the gold
  passage at a random position among their MiniLM hard negatives, as many as fit ``--train-seq-len`` tokens
  (at most ``--train-passages``), response = the first gold answer + end of turn; the 1:1 full/block mixed
  batch, loss on the answer tokens; the top ``--train-layers`` layers trained. The tuned model is a run folder
  (``--run-dir``, resumed when rerun) that ``--model`` accepts.

    rag-jax eval block_nq --limit 50                     # SmolLM2-135M-Instruct, gold at 0 / 4 / 9, no fine-tuning
    rag-jax eval block_nq --limit 10 --positions 0,9     # quick run
    rag-jax eval block_nq --modes closed --limit 200     # closed book: the question alone (general-ability row)
    rag-jax eval block_nq --limit 40 --finetune-steps 20 --train-batch 4 --train-layers 8 --train-seq-len 704 \
        --lr 1e-4 --warmup 2 --skip-base --batch-size 4  # CPU recipe: fine-tune, then the tuned model's rows
    rag-jax eval block_nq --model runs/block_nq_ft --modes block --batch-size 4   # block rows of a tuned model

Measured on 40 held-out questions (2 CPU cores, 2026-12-01; mean best-subspan EM over gold at 0 / 4 / 9):
full attention 0.208, block attention 0.058 without fine-tuning. Neither CPU recipe closed the gap:

- gold-answer targets, top 8 layers, 20 steps x 4 questions, rows of 704 tokens (25 min wall): block 0.058; the
  tuned model learned the reply format (short answer + end of turn) before the content, a third of its block
  replies were empty;
- ``--train-targets base``, all layers, lr 2e-5, 60 steps x 2 questions, rows of 1,024 tokens (6.9 passages;
  55 min wall, 58 min CPU, plus 23 min for the 150 base replies): block 0.058 (0.025 / 0.075 / 0.075), full
  attention after it 0.242 (generation kept). Only 75 of the 150 replies ended within 48 tokens, and only 26 of
  the 150 contain a gold answer while 61 begin "The document provides information about ...": at this size the
  base model's own replies mostly summarize a passage, so self-distillation teaches block mode that too. On 8
  of its training rows the tuned model's greedy block replies through the cached inference path match the
  target for 2 verbatim and 2 nearly (full mode: 6 verbatim), in line with its training loss (block 0.32, full
  0.27 nats), so the paths agree; what is missing is data: many more rows, with targets that
  answer (base replies that contain a gold answer, or gold answers in the model's sentence style), and rows
  of all 10 passages, i.e. the accelerator recipe.

    rag-jax eval block_nq --limit 40 --finetune-steps 60 --train-batch 2 --train-layers 0 --train-seq-len 1024 \
        --lr 2e-5 --warmup 5 --train-targets base --targets-cache replies.json --skip-base --modes block \
        --batch-size 4 --run-dir runs/bnq_base   # then --model runs/bnq_base --modes full for its full rows
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rag_jax.atomic import write_text
from rag_jax.data.block_rag import BlockExample, encode
from rag_jax.data.chat_blocks import ChatBlocks
from rag_jax.data.loaders import NQ_ORACLE, heldout_split, load_nq_oracle, nq_passage_pool, shared_file
from rag_jax.args import ScriptParser, input_file, int_list, integer, model_source, names, output_file, real
from rag_jax.evaluation.rag import complete_replies, generate_answers, greedy_replies, memo_json, score_answer
from rag_jax.evaluation.tables import table
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.metrics import best_subspan_em
from rag_jax.model.load import load_model
from rag_jax.retrieval.embedders import BertEmbedder, embed_texts
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.train.finetune import FinetuneConfig, finetune


MODES = ("full", "block", "closed")  # closed: the question alone (closed book), no passages
SPARE = 1.25  # --train-targets base: rows answered per row wanted (cut replies are dropped)


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


def mine_negatives(embedder, index, pool, examples, gold_ids, questions: Sequence[int], k: int) -> list[list[int]]:
    """Per question of ``questions``: its ``k`` MiniLM hard negatives from ``pool`` (``hard_negatives``), skipping
    passages that contain one of its answers."""

    q_vecs = embed_texts(embedder, [examples[i].question for i in questions], desc="MiniLM questions")
    _, ranked = index.search(q_vecs, k + 41)
    out = []
    for row, i in zip(ranked, questions):
        with_answer = [int(j) for j in row if best_subspan_em(pool[j].text, examples[i].answers)]
        out.append(hard_negatives(row, gold_ids[i], k, with_answer))
    return out


def training_examples(chat, eos_id: int, examples, texts, gold_ids, questions, negatives, seq_len: int, seed: int):
    """Block-Attention training examples that fill ``seq_len`` tokens (no padding wasted on CPU): per question its
    chat prompt blocks with the gold passage and as many of its ``negatives`` (in rank order) as fit, the gold at
    a seeded random position, and the response ``answers[0]`` + ``eos_id``. A question whose gold passage alone
    does not fit is dropped. Returns ``(examples, dropped count)``."""

    rng = np.random.default_rng(seed)
    out, dropped = [], 0
    for i, neg in zip(questions, negatives):
        blocks = chat.blocks(examples[i].question, [texts[gold_ids[i]], *[texts[j] for j in neg]])
        response = (*encode(chat.tokenizer, examples[i].answers[0]), eos_id)
        total = len(blocks[0]) + len(blocks[1]) + len(blocks[-1]) + len(response)
        k = 0
        while k < len(neg) and total + len(blocks[2 + k]) <= seq_len:
            total += len(blocks[2 + k])
            k += 1
        if total > seq_len:
            dropped += 1
            continue
        passages = place(list(range(2, 2 + k)), 1, int(rng.integers(k + 1)))
        out.append(BlockExample([blocks[0], *[blocks[j] for j in passages], blocks[-1]], response))
    return out, dropped


def own_reply_examples(loaded, rows, *, model_key: str, max_tokens: int, batch_size: int, cache=None,
                       keep_cut: bool = False) -> list:
    """``rows`` (``BlockExample``) with the base model's own greedy full-attention reply to each prompt as the
    response (+ end of turn), dropping rows whose reply is empty or was cut at ``max_tokens`` (``keep_cut``: a cut
    reply is kept without the end of turn, so no row teaches stopping mid-sentence). Trained on
    these, block mode learns to answer as full attention does and full mode keeps its reply style (gold NQ
    answers are terser than this chat model's replies: trained on them, the model learned the format before
    the content). Replies are kept in the JSON file ``cache`` when set, keyed by ``model_key`` (the model's
    name or path), ``max_tokens`` and the prompt; ``batch_size`` prompts per generate call."""

    keys = [json.dumps([model_key, max_tokens, r.blocks]) for r in rows]
    replies = memo_json(cache, keys, lambda todo: greedy_replies(
        loaded, loaded.model, [json.loads(k)[2] for k in todo], max_new_tokens=max_tokens, batch_size=batch_size),
        chunk=8 * batch_size)
    ok = complete_replies(loaded.tokenizer, replies, max_tokens)
    out = [BlockExample(r.blocks, (*encode(loaded.tokenizer, t), *([loaded.eos_ids[0]] if k else [])))
           for r, t, k in zip(rows, replies, ok) if (k or keep_cut) and t.strip()]
    print(f"base-model targets: {len(out)} of {len(rows)} rows kept ({sum(ok)} replies complete within "
          f"{max_tokens} tokens{', cut ones kept without end of turn' if keep_cut else ''})", flush=True)
    return out


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval block_nq", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct",
                   help="embedded name, .gguf file, HF or run folder")
    p.add_argument("--data", type=input_file, default=str(shared_file(*NQ_ORACLE)))
    p.add_argument("--limit", type=integer(1), default=50, help="held-out questions evaluated (the first ones)")
    p.add_argument("--heldout", type=real(0, 1, lo_open=True, hi_open=True), default=0.2,
                   help="fraction of the questions held out")
    p.add_argument("--seed", type=integer(0), default=0, help="split seed")
    p.add_argument("--num-passages", type=integer(1), default=10)
    p.add_argument("--positions", type=int_list(0), default="0,4,9", help="gold positions (0-based), comma-separated")
    p.add_argument("--max-new-tokens", type=integer(1), default=24)
    p.add_argument("--batch-size", type=integer(1), default=8,
                   help="questions per generate call (its KV cache is batch x ~1.5K tokens x 30 layers)")
    p.add_argument("--modes", type=names(MODES), default="full,block",
                   help="attention modes evaluated, comma-separated (e.g. block: only the block rows; closed: the "
                        "question alone, closed book, as a general-ability row)")
    p.add_argument("--cache", type=output_file, default=None, help="npz to reuse/store the MiniLM pool embeddings")
    p.add_argument("--out", type=output_file, default=None, help="JSON output (rewritten after every condition)")
    ft = p.add_argument_group("Block-Attention fine-tuning (rag_jax.train.finetune); off unless --finetune-steps")
    d = FinetuneConfig()
    ft.add_argument("--finetune-steps", type=integer(0), default=0, help="optimizer steps; 0 = evaluate --model only")
    ft.add_argument("--run-dir", type=Path, default=Path("runs/block_nq_ft"),
                    help="run folder of the tuned model (resumed if present; --model accepts it)")
    ft.add_argument("--train-layers", type=integer(0), default=d.train_layers,
                    help="top decoder layers trained (+ final norm); 0 = all parameters")
    ft.add_argument("--train-passages", type=integer(1), default=None,
                    help="most passages per training row (gold + hard negatives, as many as fit --train-seq-len); "
                         "default --num-passages")
    ft.add_argument("--train-batch", type=integer(1), default=d.batch_size, help="questions per step (2 rows each)")
    ft.add_argument("--train-seq-len", type=integer(16), default=d.seq_len,
                    help="training row length in tokens; longer rows dropped")
    ft.add_argument("--lr", type=real(0, lo_open=True), default=d.learning_rate)
    ft.add_argument("--warmup", type=integer(0), default=d.warmup_steps)
    ft.add_argument("--train-targets", choices=("gold", "base"), default="gold",
                    help="responses: the first gold answer, or the base model's own greedy full-attention reply to "
                         "the training prompt (rows whose reply was cut at --target-tokens are dropped)")
    ft.add_argument("--target-tokens", type=integer(1), default=48, help="with --train-targets base: reply cap")
    ft.add_argument("--targets-cache", type=output_file, default=None,
                    help="with --train-targets base: JSON keeping the base replies for reruns")
    ft.add_argument("--skip-base", action="store_true", help="evaluate only the tuned model")
    args = p.parse_args(argv)
    positions = args.positions
    if any(x >= args.num_passages for x in positions):
        p.error(f"argument --positions: {positions} must lie in [0, --num-passages={args.num_passages})")
    args.train_passages = args.num_passages if args.train_passages is None else args.train_passages
    finetune_cfg = (FinetuneConfig(steps=args.finetune_steps, batch_size=args.train_batch,
                                        seq_len=args.train_seq_len, train_layers=args.train_layers,
                                        learning_rate=args.lr, warmup_steps=args.warmup, seed=args.seed,
                                        save_every=max(1, min(10, args.finetune_steps)))
                    if args.finetune_steps else None)


    examples = load_nq_oracle(args.data)
    pool, gold_ids = nq_passage_pool(examples)
    train, heldout = heldout_split(len(examples), args.heldout, args.seed)
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
    negatives = mine_negatives(emb, index, pool, examples, gold_ids, heldout, args.num_passages - 1)

    loaded = load_model(args.model)
    info: dict = {}                               # fine-tuning record for --out
    models = {"": loaded} if args.finetune_steps == 0 else {" (no FT)": loaded}
    if finetune_cfg is not None:
        # One pass over `steps x batch` training questions (more, for dropped ones).
        wanted = finetune_cfg.steps * finetune_cfg.batch_size
        base_targets = args.train_targets == "base"
        order = np.random.default_rng(args.seed).permutation(train)[:int(wanted * (SPARE if base_targets else 1)) + 16]
        train_neg = mine_negatives(emb, index, pool, examples, gold_ids, order.tolist(), args.train_passages - 1)
        rows, dropped = training_examples(ChatBlocks(loaded), loaded.eos_ids[0], examples, texts, gold_ids,
                                          order.tolist(), train_neg,
                                          finetune_cfg.seq_len - (args.target_tokens + 1 if base_targets else 0),
                                          args.seed)
        if base_targets:
            rows = own_reply_examples(loaded, rows[:int(wanted * SPARE)], model_key=str(args.model),
                                      max_tokens=args.target_tokens, batch_size=args.batch_size,
                                      cache=args.targets_cache)
        rows = rows[:wanted]
        print(f"fine-tuning: {len(rows)} training questions ({dropped} dropped: gold passage alone > "
              f"{finetune_cfg.seq_len} tokens), {np.mean([len(r.blocks) - 2 for r in rows]):.1f} passages and "
              f"{np.mean([r.num_tokens for r in rows]):.0f} tokens per row; {finetune_cfg}", flush=True)
        data_cfg = {"block_nq": {"data": str(args.data), "heldout": args.heldout, "seed": args.seed,
                                 "train_passages": args.train_passages, "base_model": str(args.model)}}
        wall, cpu = time.perf_counter(), time.process_time()
        result = finetune(loaded, rows, finetune_cfg, args.run_dir, extra_config=data_cfg)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        info["finetune"] = {"rows": len(rows), "steps": result.step, "wall_seconds": wall, "cpu_seconds": cpu,
                            "train_seconds": result.train_seconds, "compile_seconds": result.compile_seconds,
                            "history": result.history}
        print(f"fine-tuning: {result.step} steps, {result.train_seconds:.0f} s training + "
              f"{result.compile_seconds:.0f} s compile; {wall:.0f} s wall, {cpu:.0f} s CPU (all threads, compile "
              f"and checkpoints included); last loss_full {result.history[-1]['loss_full']:.3f}, "
              f"loss_block {result.history[-1]['loss_block']:.3f}", flush=True)
        del result, loaded  # the train state (params + Adam moments) is not needed for evaluation
        models = ({} if args.skip_base else models) | {" (after FT)": load_model(args.run_dir)}
    results = evaluate(models, examples, texts, gold_ids, heldout, negatives, positions, args, info)
    rows = [[name, *[results[name][x]["subspan_em"] for x in positions],
             np.mean([results[name][x]["subspan_em"] for x in positions])] for name in results]
    print(f"# {args.model}, NQ-open held-out: {len(heldout)} questions, {args.num_passages} passages (gold + MiniLM "
          f"hard negatives from {len(pool)} gold passages); best-subspan EM")
    print(table(["inference", *[f"gold@{x}" for x in positions], "mean"], rows))
    return 0


def evaluate(models: dict, examples, texts, gold_ids, heldout, negatives, positions, args,
             info: dict | None = None) -> dict:
    """Best-subspan EM per ``"{mode}{model name}"`` condition and gold position: block then full for a tuned
    model, full then block otherwise (the table's order), the modes of ``args.modes`` only (default both). Writes ``args.out`` (with ``info``, e.g. the
    fine-tuning record) after every condition.

    Each chunk of ``args.batch_size`` questions is answered at every gold position before the next chunk, so in
    block mode its passage blocks are encoded once and reused from the KV store (which needs to hold one
    chunk's blocks only); ``seconds`` (wall) and ``cpu_seconds`` (process CPU, all threads) are the condition's
    times split evenly over its positions, compilation included."""
    import jax


    results: dict[str, dict] = {}
    for name, loaded in models.items():
        chat = ChatBlocks(loaded)
        ba = BlockAttention(loaded.model, fingerprint=str(loaded.source), prefix=loaded.block_prefix)
        modes = [m for m in (("block", "full", "closed") if "after" in name else ("full", "block", "closed"))
                 if m in getattr(args, "modes", ("full", "block"))]
        for mode in modes:
            preds: dict[int, list[str]] = {pos: [] for pos in positions}
            t0, c0 = time.perf_counter(), time.process_time()
            for start in range(0, len(heldout), args.batch_size):
                chunk = list(zip(negatives, heldout))[start:start + args.batch_size]
                for pos in positions[:1] if mode == "closed" else positions:
                    prompts = [chat.blocks(examples[i].question, [] if mode == "closed" else
                                           [texts[j] for j in place(neg, gold_ids[i], pos)]) for neg, i in chunk]
                    preds[pos] += generate_answers(ba, loaded.tokenizer, prompts, mode="full" if mode == "closed"
                                                   else mode, max_new_tokens=args.max_new_tokens,
                                                   batch_size=args.batch_size, eos_id=loaded.eos_ids)
            if mode == "closed":                  # no passages, no position: the same replies in every column
                preds = {pos: preds[positions[0]] for pos in positions}
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            cond = results.setdefault(f"{mode}{name}", {})
            for pos in positions:
                em = [score_answer(pr, examples[i].answers, golds_are_set=False)["subspan_em"]
                      for pr, i in zip(preds[pos], heldout)]
                cond[pos] = {"subspan_em": float(np.mean(em)), "seconds": seconds / len(positions),
                             "cpu_seconds": cpu / len(positions), "predictions": preds[pos]}
                if mode != "closed":
                    print(f"  {mode} attention{name}, gold at {pos}: best-subspan EM {np.mean(em):.3f}", flush=True)
            if mode == "closed":
                print(f"  closed book{name} (no passages): best-subspan EM {cond[positions[0]]['subspan_em']:.3f} "
                      f"({seconds:.0f} s wall, {cpu:.0f} s CPU for {len(heldout)} questions)", flush=True)
            else:
                print(f"  ({mode} attention{name}: {seconds:.0f} s wall, {cpu:.0f} s CPU for {len(heldout)} questions "
                      f"x {len(positions)} positions)", flush=True)
            jax.clear_caches()                    # compiled programs of this condition's shapes: memory
            if args.out is not None:
                write_text(args.out, json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                 "questions": len(heldout), **(info or {}), "results": results},
                                                indent=1, default=float))
    return results


if __name__ == "__main__":
    raise SystemExit(main())
