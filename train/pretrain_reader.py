"""Pretrain the demo's reader base: ``python train/pretrain_reader.py --out rag_jax/assets/demo_reader``.

``rag-jax demo`` fine-tunes a base model with GRIT + Block-Attention, as GritLM (Mistral) and Block-Attention
(Llama) fine-tune pretrained LMs. A model trained from scratch inside the demo's 10-minute CPU budget does not
learn to read (held-out EM stays at the ~0.15 that guessing the gender gives, measured up to 1,000 steps): copying
an attribute out of a passage is an induction-style skill that appears only after ~10K answered rows. This
script gives the base that skill on fictional universes that the demo never uses (generator seeds 100+; the
demo trains on seed 0 and evaluates on seed 1), and ships it as an HF-format folder.

Recipe (measured on 2 CPU cores; the numbers it reached are written to ``reader.json``):
- data: ``--universes`` PhantomWiki-style universes (``rag_jax.data.phantom``) of ``--people`` people; every
  1-hop attribute question ("What is the hobby of X?") with its section passage, in the demo's prompt layout
  (``rag_jax.data.phantom_rag.rag_example``: passages, then ``Question: ...\\nAnswer:``, response ``" answer<eos>"``);
- rows: the gold passage plus 0..k-1 distractors (the person's other sections, other people's passages of the
  same section, random passages), shuffled; the first half of training uses the gold passage alone (learning
  to find the attribute's line comes before learning to find the person). Up to ``--turns - 1`` earlier
  answered questions about the same passages precede the question (more answers per row);
- loss: full causal attention, answer tokens weighted ``--answer-weight``, passage tokens ``--passage-weight``
  (next-token loss: the base also models the articles), question tokens 0;
- model: 3 layers, hidden 128, 4 query / 2 KV heads, byte-level BPE of ``--vocab`` tokens trained on the
  pretraining universes. A 2-layer model was still at the gender-guessing level (EM 0.15) after 300 steps;
  3 layers reached 0.43 (gold passage alone) after 600 (as for the passkey reader, ``eval/passkey.py``).
- the shipped base: these defaults, 2,400 steps in 40 min on 2 CPU cores; held-out EM 0.97 with the gold passage
  alone, 0.93 next to another section of the same person, 0.54 next to another person's same section.

Output: ``config.json`` + ``model.safetensors`` (``rag_jax.model.hf.save_hf``, Llama layout) + ``tokenizer.json``
+ ``reader.json`` (recipe, held-out exact match), written to a temporary folder and renamed into place. A
killed run resumes from its last orbax checkpoint in ``<out>.ckpt`` (data is a function of the step).
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from rag_jax.args import ScriptParser

HELDOUT_SEED = 200  # the universe the script reports exact match on (neither a training nor a demo seed)


def parse_args(argv=None):
    p = ScriptParser(description=__doc__)
    p.add_argument("--out", required=True, help="output folder (HF format + tokenizer.json + reader.json)")
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch", type=int, default=16, help="rows per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--universes", type=int, default=4, help="training universes (seeds 100, 101, ...)")
    p.add_argument("--people", type=int, default=2000, help="people per universe")
    p.add_argument("--max-passages", type=int, default=3, help="passages per row in the second half")
    p.add_argument("--turns", type=int, default=4, help="answered questions per row (the last one included)")
    p.add_argument("--answer-weight", type=float, default=5.0)
    p.add_argument("--passage-weight", type=float, default=0.1)
    p.add_argument("--seq-len", type=int, default=320, help="row length in tokens (longer rows are redrawn)")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-questions", type=int, default=100, help="held-out questions per evaluation")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "batch", "layers", "hidden", "universes", "people", "max_passages", "turns", "seq_len",
                 "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


class Universe:
    """One universe's section passages and 1-hop attribute questions, indexed for row building."""

    def __init__(self, seed: int, people: int):
        from rag_jax.data import phantom_rag
        from rag_jax.data.phantom import generate_universe
        u = generate_universe(people, seed, max_hops=1, num_questions=10 * people)
        self.articles = u.articles
        self.passages = phantom_rag.article_passages(u.articles)
        self.questions = phantom_rag.select_questions(u.questions, self.passages, "attribute", 1, 1)
        self.by_passage: dict[int, list[dict]] = {}
        for q in self.questions:
            self.by_passage.setdefault(q["gold"][0], []).append(q)
        self.by_title: dict[str, list[int]] = {}
        self.by_section: dict[str, list[int]] = {}
        for i, p in enumerate(self.passages):
            self.by_title.setdefault(p["title"], []).append(i)
            self.by_section.setdefault(p["section"], []).append(i)

    def row(self, q: dict, k: int, turns: int, rng: random.Random):
        """``(passage indices, earlier questions)`` of one row about question ``q`` with ``k`` passages."""
        gold = q["gold"][0]
        chosen = [gold]
        pools = (self.by_title[self.passages[gold]["title"]], self.by_section[self.passages[gold]["section"]],
                 range(len(self.passages)))
        while len(chosen) < k:
            pool = pools[rng.randrange(3)]
            i = pool[rng.randrange(len(pool))]
            if i not in chosen:
                chosen.append(i)
        rng.shuffle(chosen)
        others = [o for i in chosen for o in self.by_passage.get(i, ()) if o is not q]
        rng.shuffle(others)
        return chosen, others[:rng.randrange(turns)]


def encode_row(tok, u: Universe, q: dict, chosen, earlier, cache: dict):
    """Token blocks + response and the answer spans of the earlier turns (offsets in the last block)."""
    from rag_jax.data import phantom_rag as pr
    from rag_jax.data.block_rag import BlockExample, encode

    def enc(text):
        if text not in cache:
            cache[text] = tuple(encode(tok, text))
        return cache[text]

    last, spans = pr.turns_block([(enc(pr.question_block(o["question"])), enc(" " + pr.answer_text(o["answer"]) + pr.EOS))
                                  for o in earlier], enc("\n"), enc(pr.question_block(q["question"])))
    blocks = tuple(enc(u.passages[i]["text"]) for i in chosen) + (last,)
    return BlockExample(blocks, enc(" " + pr.answer_text(q["answer"]) + pr.EOS)), spans


def make_batch(tok, universes, step: int, args, cache: dict) -> dict[str, np.ndarray]:
    """The rows of ``step`` (a function of the step and seed only, so a resumed run sees the same data)."""
    from rag_jax.data.phantom_rag import weighted_rag_batch
    rng = random.Random(args.seed * 1_000_003 + step)
    max_k = 1 if step < args.steps // 2 else args.max_passages
    rows = []
    while len(rows) < args.batch:
        u = universes[rng.randrange(len(universes))]
        q = u.questions[rng.randrange(len(u.questions))]
        ex, spans = encode_row(tok, u, q, *u.row(q, rng.randint(1, max_k), args.turns, rng), cache)
        if ex.num_tokens <= args.seq_len:
            rows.append((ex, spans))
    return weighted_rag_batch(rows, args.seq_len, answer_weight=args.answer_weight,
                                   passage_weight=args.passage_weight)


def heldout_em(model, tok, u: Universe, n: int = 100) -> dict[str, float]:
    """Set exact match of greedy answers on ``n`` held-out questions: gold passage alone (``gold``) and gold plus
    one of the person's other sections / one other person's passage of the same section (block inference)."""
    from rag_jax.evaluation.rag import generate_answers, score_answer
    from rag_jax.inference.block_attention import BlockAttention
    ba, out = BlockAttention(model), {}
    qs = u.questions[:n]
    for name, pick in (("gold", lambda g: [g]),
                       ("gold+same_person", lambda g: [g, next(i for i in u.by_title[u.passages[g]["title"]]
                                                             if i != g)]),
                       ("gold+same_section", lambda g: [next(i for i in u.by_section[u.passages[g]["section"]]
                                                            if u.passages[i]["title"] != u.passages[g]["title"]), g])):
        prompts = [list(encode_row(tok, u, q, pick(q["gold"][0]), [], {})[0].blocks) for q in qs]
        preds = generate_answers(ba, tok, prompts, mode="block", max_new_tokens=12, batch_size=128)
        out[name] = float(np.mean([score_answer(p, q["answer"])["set_em"] for p, q in zip(preds, qs)]))
    return out


def export(out: Path, model, tok, info: dict) -> None:
    """HF folder + tokenizer + reader.json, written next to ``out`` and renamed into place."""
    from rag_jax.atomic import MARKER, replace_directory
    from rag_jax.tokenizer import save_tokenizer
    from rag_jax.model.hf import save_hf
    with replace_directory(out) as tmp:
        save_hf(model, tmp / "model")
        (tmp / "model" / MARKER).unlink(missing_ok=True)  # the HF export's marker; the folder gets its own
        for f in (tmp / "model").iterdir():
            f.rename(tmp / f.name)
        (tmp / "model").rmdir()
        save_tokenizer(tok, tmp / "tokenizer.json")
        (tmp / "reader.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    from flax import nnx

    from rag_jax import sharding
    from rag_jax.tokenizer import BOS, EOS, PAD
    from rag_jax.tokenizer import train_bpe
    from rag_jax.model import ModelConfig
    from rag_jax.train import optim, trainer
    from rag_jax.train.checkpoint import CheckpointConfig
    from rag_jax.train.objectives.block import BlockLoss

    out = Path(args.out)
    t0 = time.time()
    universes = [Universe(100 + i, args.people) for i in range(args.universes)]
    heldout = Universe(HELDOUT_SEED, 100)
    tok = train_bpe((t for u in universes for t in [a["article"] for a in u.articles] + [q["question"] for q in u.questions]),
                    args.vocab, special_tokens=(PAD, BOS, EOS, "<unk>"))
    print(f"{sum(len(u.questions) for u in universes)} training questions in {args.universes} universes, "
          f"{len(heldout.questions)} held-out; data + tokenizer {time.time() - t0:.0f} s", flush=True)
    cfg = trainer.RunConfig(
        model=ModelConfig(vocab_size=-(-tok.get_vocab_size() // 64) * 64, hidden_size=args.hidden,
                          intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                          max_seq_len=1024),
        optimizer=optim.OptimizerConfig(learning_rate=args.lr, warmup_steps=20, weight_decay=0.0, min_lr_ratio=0.1),
        train=trainer.TrainConfig(steps=args.steps, seed=args.seed, log_every=args.eval_every,
                                  eval_every=args.eval_every),
        checkpoint=CheckpointConfig(dir=str(out.with_name(out.name + ".ckpt").resolve()), save_every=args.eval_every,
                                    keep=1, async_save=False),
        logging=trainer.LoggingConfig(jsonl=False, tensorboard=False))
    cache: dict = {}
    task = trainer.Task(BlockLoss(block_weight=0.0), lambda step: make_batch(tok, universes, step, args, cache),
                        name="reader pretraining",
                        evaluate=lambda graphdef, params: heldout_em((graphdef, params), tok, heldout,
                                                                     args.eval_questions))
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    result = trainer.run(cfg, task, mesh=mesh, hooks=[lambda info: print(json.dumps(
        {"step": info.step, "loss": info.metrics["loss"], "elapsed_s": round(time.time() - t0, 1)}), flush=True)])
    if result.start_step:
        print(f"resumed at step {result.start_step}", flush=True)
    losses = {h["step"]: h["loss"] for h in result.history}
    history = [{"step": step, "loss": losses.get(step), **em} for step, em in result.eval if step]
    info = {"recipe": {k: v for k, v in vars(args).items() if k != "out"}, "train_seeds": [100 + i for i in range(args.universes)],
            "heldout_seed": HELDOUT_SEED, "history": history, "seconds": round(time.time() - t0, 1)}
    export(out, nnx.merge(result.graphdef, result.state.params), tok, info)
    print(f"wrote {out} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
