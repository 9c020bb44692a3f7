"""GRIT fine-tuning of a pretrained chat model (SmolLM2-135M-Instruct) on NQ-open: retrieval and oracle-passage EM.

GritLM (ICLR 2025, §2-3): one model trained with ``L_Rep + L_Gen`` matches an embedding-only model on
retrieval and keeps its generation. Here the model starts from a pretrained checkpoint with its own tokenizer
and chat template (issue 17, item 3):

- data: ``nq-open-oracle.jsonl.gz``; the pool of all gold passages (``nq_passage_pool``, texts
  ``"{title}\\n{text}"``); a seeded split into held-out and training questions;
- embedding mode (``GritLoss`` / ``GritEmbedder`` conventions): bidirectional attention, mean pooling over the
  text only (instruction and format tokens excluded, GritLM §2), ChatML turns with an ``embed`` role
  (``rag_jax.data.grit.ChatGritFormat``); queries with ``--instruction``, passages without, passages cut to
  ``--passage-len`` tokens;
- training data: per training question the query, its gold passage and ``--negatives`` hard negatives (the
  base model's top-ranked training passages that are not gold and contain no answer); generative rows
  ``[passage window around the answer + question (the demo's RAG prompt) -> response]`` in the chat template,
  loss on the response and its end-of-turn token. ``--gen-targets base`` (default): the response is the base
  model's own greedy reply, so the generative loss keeps the model's generation while the shared top layers
  learn embeddings (GritLM trains on instruction data, Tülu 2, for that role); ``gold``: the gold answer (a
  new, terse answer style that 2 trained layers and a few hundred rows learn poorly: oracle EM fell from 0.36
  to 0.26 in our run);
- recipe (CPU): only the top ``--top-layers`` decoder layers and the final norm are trained
  (``optimizer.trainable``; embedding and lower layers frozen); the frozen lower layers run once per distinct
  input (``rag_jax.train.frozen_bottom``, exact) and are cached in ``--cache-dir``, so the train steps and the
  tuned models' embeddings run only the top layers. ``unified`` (both losses) and ``embedding`` (L_Rep only)
  train the same steps on the same data order through the one trainer;
- evaluation: recall@1/5/20 of held-out questions over ``--pool`` passages (their gold passages plus random
  others) for the base model, the tuned models and MiniLM (``BertEmbedder``, full passages); oracle-passage
  best-subspan EM (greedy, chat prompt, ``rag_jax.data.chat_blocks.ChatBlocks``, full attention) of the base
  and the unified model on the held-out questions.

Measured (defaults; 2 shared CPU cores, ~35 min with the caches warm): recall@1/5/20 base 0.14 / 0.26 / 0.40,
unified 0.38 / 0.58 / 0.79, embedding-only 0.37 / 0.62 / 0.79, MiniLM 0.95 / 0.98 / 1.00 (unified vs
embedding-only at recall@5: 0 vs 4 discordant questions, McNemar p = 0.12); oracle EM base 0.36, unified 0.31.
With ``--complete-targets`` (84 of the 200 base replies ended within 24 tokens): recall@5 0.59, oracle EM 0.27:
38 of 100 unified replies begin "The answer to this question is" and often restate the question, so cut
targets were not the cause; two shared layers trained on a few hundred rows drift from the base model's
generation (GritLM anchors it with Tülu 2 instruction data).
With the KL anchor (``--kl-factor``, KL to the frozen base model on every generative-row position) and 300
held-out questions for retrieval (``--eval-questions 300 --em-questions 100 --gen-len 256``; 2 CPU cores,
2026-12-01; the embedding-only model is the same for every row of one ``--top-layers``):

  =========================  ======  ======  ======  ==========  ==============  ==========
  model                      R@1     R@5     R@20    EM          R@5 vs emb.     EM vs base
  =========================  ======  ======  ======  ==========  ==============  ==========
  base                       0.150   0.287   0.410   0.36
  top 2, KL 1, unified       0.423   0.627   0.763   0.35        -1.7 (0 vs 5)   -1
  top 2, embedding-only      0.433   0.643   0.773
  top 4, KL 1, unified       0.480   0.693   0.807   0.30        -1.0 (0 vs 3)   -6
  top 4, KL 3, unified       0.477   0.693   0.807   0.33        -1.0 (0 vs 3)   -3
  top 4, KL 10, unified      0.470   0.690   0.807   0.36        -1.3 (0 vs 4)   0
  top 4, KL 10, λ_Gen 0.1    0.483   0.697   0.803   0.38        -0.7 (0 vs 2)   +2
  top 4, embedding-only      0.493   0.703   0.820
  top 6, KL 10, unified      0.517   0.710   0.823   0.35        -1.7 (1 vs 6)   -1
  top 6, embedding-only      0.533   0.727   0.853
  MiniLM                     0.960   0.993   1.000
  =========================  ======  ======  ======  ==========  ==============  ==========

(discordant questions unified-only vs embedding-only-only in brackets; McNemar p 0.06-0.5). The KL term keeps
generation (EM 0.31 without it, 0.36 at KL 10) at little cost to retrieval; two more trained layers add 6
points of recall@5 to both models, two more again 2 points, with the gap unchanged. The recipe that meets
GritLM's claim here is ``--top-layers 4 --kl-factor 10 --gen-factor 0.1`` (λ_Gen 0.1, GritLM Eq. 3; its 8x7B
model used 0.003): the next-token loss stops competing with the contrastive one for the 4 shared layers while
the KL term holds generation (recall@5 0.697 vs 0.703, EM 0.38 vs 0.36): 22 min wall on one XLA thread with the
caches warm (train 762 s). ``--top-layers 4 --kl-factor 10`` took 15 min wall on 2 threads.

    rag-jax eval grit_pretrained                                 # defaults: 100 held-out, pool 1000
    rag-jax eval grit_pretrained --eval-questions 300 --em-questions 100 --gen-len 256 --top-layers 4 \
        --kl-factor 10 --gen-factor 0.1 --cache-dir runs/grit_cache    # the recipe in the table
    rag-jax eval grit_pretrained --eval-questions 40 --pool 200 --train-questions 200 --steps 20  # smoke run
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax import sharding
from rag_jax.atomic import write_text
from rag_jax.data.grit import ChatGritFormat, GritDataConfig, grit_batches, tokenize_generative_record
from rag_jax.data.loaders import NQ_ORACLE, load_nq_oracle, nq_passage_pool, shared_file
from rag_jax.data.chat_blocks import INSTRUCTION as ANSWER_INSTRUCTION, PASSAGE, QUESTION, ChatBlocks
from rag_jax.args import ScriptParser, input_file, integer, model_source, names, output_file, real
from rag_jax.recipes.grit.grit_eval import answer_window
from rag_jax.evaluation.rag import complete_replies, greedy_replies, memo_json
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer
from rag_jax.metrics import best_subspan_em, recall_of_scores
from rag_jax.model.embedding import GritEmbedder, tokenize_for_embedding
from rag_jax.model.load import load_model
from rag_jax.retrieval.embedders import BertEmbedder, embed_texts
from rag_jax.train import checkpoint, optim, trainer
from rag_jax.train.frozen_bottom import TOP_TRAINABLE, FrozenBottom, merge_top, split_model
from rag_jax.train.objectives.grit import GritConfig, GritLoss

INSTRUCTION = "Given a question, retrieve Wikipedia passages that answer the question"
KS = (1, 5, 20)


@dataclasses.dataclass
class NQSplit:
    """Held-out and training questions over the gold-passage pool (indices into ``texts``)."""

    texts: list[str]                # every pool passage, "{title}\n{text}"
    questions: list[str]            # every question
    answers: list[tuple[str, ...]]
    gold: list[int]                 # question -> pool index of its gold passage
    heldout: list[int]              # held-out question indices
    train: list[int]                # training question indices
    corpus: list[int]               # pool indices searched at evaluation (held-out golds first)


def split_nq(examples, *, eval_questions: int, train_questions: int, pool: int, seed: int) -> NQSplit:
    """Seeded split: the first ``eval_questions`` of a permutation are held out, the next ``train_questions``
    whose gold passage is no held-out question's train; the corpus is the held-out gold passages plus random
    other pool passages, ``pool`` in all.

    Raises:
      ValueError: more questions or passages asked for than the data has, or a pool smaller than the held-out
        gold passages.
    """
    passages, gold = nq_passage_pool(examples)
    if eval_questions < 1 or train_questions < 1 or eval_questions + train_questions > len(examples):
        raise ValueError(f"eval_questions={eval_questions} + train_questions={train_questions} must be >= 1 each "
                         f"and at most the {len(examples)} questions")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(examples)).tolist()
    heldout = order[:eval_questions]
    golds = list(dict.fromkeys(gold[i] for i in heldout))
    train = [i for i in order[eval_questions:] if gold[i] not in set(golds)][:train_questions]
    if not len(golds) <= pool <= len(passages):
        raise ValueError(f"pool={pool} must be in [{len(golds)} held-out gold passages, {len(passages)} passages]")
    others = [j for j in rng.permutation(len(passages)).tolist() if j not in set(golds)]
    return NQSplit([f"{p.title}\n{p.text}" for p in passages], [ex.question for ex in examples],
                   [ex.answers for ex in examples], gold, heldout, train, golds + others[:pool - len(golds)])


def recall(scores: np.ndarray, gold: Sequence[int], ks: Sequence[int] = KS) -> dict[str, float]:
    """``{"recall@k": ...}`` of the descending ``scores [queries, corpus]`` ranking (``metrics.recall_of_scores``)."""
    return {f"recall@{k}": v for k, v in recall_of_scores(scores, gold, ks).items()}


def gold_ranks(scores: np.ndarray, gold: Sequence[int]) -> list[int]:
    """0-based rank of each row's gold column in the descending, stable ``scores [queries, corpus]`` ranking
    (per-question hits for paired comparisons: hit@k is ``rank < k``)."""
    order = np.argsort(-scores, axis=1, kind="stable")
    return [int(np.flatnonzero(row == g)[0]) for row, g in zip(order, gold)]


def discordant(ranks_a: Sequence[int], ranks_b: Sequence[int], k: int) -> tuple[int, int, float]:
    """Paired hit@k comparison of two models on the same questions: ``(questions only a hits, only b hits,
    two-sided exact sign-test p-value of that split)`` (McNemar's exact test)."""
    from scipy.stats import binomtest
    a = sum(x < k <= y for x, y in zip(ranks_a, ranks_b))
    b = sum(y < k <= x for x, y in zip(ranks_a, ranks_b))
    return a, b, (binomtest(a, a + b).pvalue if a + b else 1.0)


def hard_negatives(scores: np.ndarray, gold: Sequence[int], excluded: Sequence[set[int]], n: int) -> list[list[int]]:
    """Per row of ``scores [queries, passages]``: the ``n`` best-scored passages other than ``gold[i]`` and
    ``excluded[i]`` (passages that contain an answer), best first.

    Raises:
      ValueError: a row has fewer than ``n`` candidates left.
    """
    out = []
    for i, row in enumerate(np.argsort(-scores, axis=1, kind="stable")):
        picked = [int(j) for j in row if j != gold[i] and j not in excluded[i]][:n]
        if len(picked) < n:
            raise ValueError(f"query {i} has only {len(picked)} hard-negative candidates, {n} needed")
        out.append(picked)
    return out


def oracle_prompt(question: str, passage: str) -> str:
    """The user message of the demo's RAG prompt (``rag_jax.recipes.rag_demo.real_model``) with one passage."""
    return ANSWER_INSTRUCTION + PASSAGE.format(text=passage.strip()) + QUESTION.format(question=question)


def with_inputs_embeds(batch: dict[str, np.ndarray], frozen, teacher=None) -> dict[str, np.ndarray]:
    """A GRIT batch plus the frozen bottom's ``{query,passage,gen}_inputs_embeds`` for the streams it has, and
    with ``teacher = (FrozenBottom of the whole base model, its final norm)`` the ``gen_teacher_hidden`` of
    ``GritConfig.gen_kl_factor`` (the base model's hidden states after its final norm)."""
    modes = {"query": "bidirectional", "passage": "bidirectional", "gen": "causal"}
    out = dict(batch)
    for side, mode in modes.items():
        if f"{side}_tokens" in batch:
            out[f"{side}_inputs_embeds"] = frozen.inputs_embeds(mode, batch[f"{side}_tokens"],
                                                                batch[f"{side}_attention_mask"])
    if teacher is not None and "gen_tokens" in batch:
        base, final_norm = teacher
        residual = base.inputs_embeds("causal", batch["gen_tokens"], batch["gen_attention_mask"])
        out["gen_teacher_hidden"] = np.asarray(final_norm(jnp.asarray(residual)))
    return out


# Arguments that define a tuned model (its run folder name hashes them; another recipe trains a new one).
RECIPE_ARGS = ("model", "data", "eval_questions", "train_questions", "gen_train", "seed", "instruction", "query_len",
               "passage_len", "gen_len", "gen_context_words", "gen_targets", "max_new_tokens", "negatives",
               "top_layers", "steps", "batch_size", "group_size", "gen_batch_size", "lr", "warmup", "temperature",
               "gen_factor")


def train_top(args, mode: str, top, frozen, emb_records, gen_records, tokenizer, fmt, data_cfg, gen_window: int,
              teacher=None):
    """Train the top model in GRIT ``mode`` in the run folder ``<cache-dir>/top_<mode>_<recipe hash>`` (a finished
    run is loaded, not retrained) -> ``(trained top params, TrainResult)``. ``teacher``: see ``with_inputs_embeds``
    (unified mode with ``--kl-factor``)."""
    import hashlib

    recipe = {k: str(getattr(args, k)) for k in RECIPE_ARGS}
    if args.complete_targets:  # only when set: the recipes (run folders) of earlier runs keep their names
        recipe["complete_targets"] = "True"
    kl_factor = args.kl_factor if mode == "unified" else 0.0
    if kl_factor:
        recipe["kl_factor"] = str(kl_factor)
    run_dir = args.cache_dir / f"top_{mode}_{hashlib.sha1(json.dumps(recipe).encode()).hexdigest()[:10]}"
    batches = grit_batches(emb_records, gen_records if mode == "unified" else None, tokenizer, data_cfg, fmt)
    loss_fn = GritLoss(GritConfig(mode=mode, temperature=args.temperature, loss_gen_factor=args.gen_factor,
                                  gen_window=gen_window, gen_kl_factor=kl_factor))
    teacher = teacher if kl_factor else None
    run_cfg = trainer.RunConfig(
        model=top.config, mesh=sharding.MeshConfig(data=1, fsdp=-1, tensor=1),
        optimizer=optim.OptimizerConfig(learning_rate=args.lr, warmup_steps=args.warmup, weight_decay=0.0,
                                        trainable=TOP_TRAINABLE),
        train=trainer.TrainConfig(steps=args.steps, seed=args.seed, log_every=max(1, args.steps // 10),
                                  run_dir=str(run_dir)),
        checkpoint=checkpoint.CheckpointConfig(save_every=args.steps, keep=1, async_save=False),
        logging=trainer.LoggingConfig(tensorboard=False))
    task = trainer.Task(loss_fn, lambda step: with_inputs_embeds(next(batches), frozen, teacher), name=f"GRIT {mode}",
                        progress_keys=("loss_rep", "loss_gen", "rep_accuracy", *(("loss_kl",) if kl_factor else ())))
    result = trainer.run(run_cfg, task, init_params=nnx.state(top, nnx.Param),
                         extra_config={"grit_pretrained": {"mode": mode, **recipe}})
    return result.state.params, result


def answers(loaded, model, pairs: Sequence[tuple[str, str]], args) -> list[str]:
    """Greedy replies of ``model`` to the demo's RAG prompt with one passage, per ``(question, passage)``
    (``rag_jax.data.chat_blocks.ChatBlocks``, full attention)."""
    chat = ChatBlocks(loaded)
    return greedy_replies(loaded, model, [chat.blocks(q, [passage]) for q, passage in pairs],
                          max_new_tokens=args.max_new_tokens, batch_size=args.em_batch_size)


def base_targets(loaded, pairs: Sequence[tuple[str, str]], args) -> list[str]:
    """The base model's own greedy replies to the generative training prompts (``--gen-targets base``), kept in
    ``<cache-dir>/base_replies.json`` (keyed by model, prompt and length) so a rerun does not regenerate them."""
    keys = [json.dumps([args.model, args.max_new_tokens, q, passage]) for q, passage in pairs]
    by_key = dict(zip(keys, pairs))
    return memo_json(args.cache_dir / "base_replies.json", keys,
                     lambda todo: answers(loaded, loaded.model, [by_key[k] for k in todo], args))


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval grit_pretrained", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct",
                   help="embedded name, .gguf file or HF folder")
    p.add_argument("--data", type=input_file, default=str(shared_file(*NQ_ORACLE)))
    p.add_argument("--eval-questions", type=integer(1), default=100, help="held-out questions (retrieval and EM)")
    p.add_argument("--train-questions", type=integer(1), default=500)
    p.add_argument("--gen-train", type=integer(0), default=200,
                   help="training questions that also give a generative row")
    p.add_argument("--pool", type=integer(1), default=1000, help="passages searched at evaluation")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--instruction", default=INSTRUCTION, help="query instruction (passages get none)")
    p.add_argument("--query-len", type=integer(8), default=48, help="query tokens incl. the instruction and format")
    p.add_argument("--passage-len", type=integer(8), default=64, help="passage tokens incl. the format prefix")
    p.add_argument("--gen-len", type=integer(16), default=192, help="generative row tokens (chat template included)")
    p.add_argument("--gen-context-words", type=integer(1), default=48, help="passage words around the answer per row")
    p.add_argument("--gen-targets", choices=("base", "gold"), default="base",
                   help="generative responses: the base model's own replies (keeps its generation) or the gold answers")
    p.add_argument("--complete-targets", action="store_true",
                   help="with --gen-targets base: train only on replies that ended before --max-new-tokens (a reply "
                        "cut there, followed by the end-of-turn target, teaches stopping mid-sentence)")
    p.add_argument("--negatives", type=integer(0), default=4, help="base-model hard negatives kept per training query")
    p.add_argument("--top-layers", type=integer(1), default=2, help="top decoder layers trained (+ final norm)")
    p.add_argument("--steps", type=integer(1), default=100)
    p.add_argument("--batch-size", type=integer(2), default=16, help="queries per step (in-batch negatives)")
    p.add_argument("--group-size", type=integer(1), default=2, help="passages per query: positive + hard negatives")
    p.add_argument("--gen-batch-size", type=integer(1), default=4, help="generative rows per step (unified)")
    p.add_argument("--lr", type=real(0, lo_open=True), default=1e-4)
    p.add_argument("--warmup", type=integer(0), default=10)
    p.add_argument("--temperature", type=real(0, lo_open=True), default=0.02)
    p.add_argument("--gen-factor", type=real(0), default=1.0, help="lambda_Gen")
    p.add_argument("--kl-factor", type=real(0), default=0.0,
                   help="unified: weight of KL(base model || tuned) on every position of the generative rows "
                        "(GritConfig.gen_kl_factor; needs tied embeddings); 0 = off")
    p.add_argument("--modes", type=names(("unified", "embedding")), default="unified,embedding",
                   help="tuned models: unified, embedding")
    p.add_argument("--em-questions", type=integer(0), default=None,
                   help="held-out questions for EM (default all; 0 = no EM)")
    p.add_argument("--max-new-tokens", type=integer(1), default=24)
    p.add_argument("--em-batch-size", type=integer(1), default=16)
    p.add_argument("--no-minilm", action="store_true")
    p.add_argument("--cache-dir", type=Path, default=Path("runs/grit_pretrained"),
                   help="frozen-bottom features (bottom<layers>.npz) and tuned-model run folders, reused when present")
    p.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = p.parse_args(argv)
    modes = args.modes

    timer = StageTimer()
    loaded = load_model(args.model)
    if args.kl_factor and not loaded.config.tie_embeddings:
        p.error(f"argument --kl-factor: {args.model} has an untied output head, which the top model trains; the "
                "KL term reads the teacher's logits through the model's head, so it needs tied embeddings")
    split = split_nq(load_nq_oracle(args.data), eval_questions=args.eval_questions,
                     train_questions=args.train_questions, pool=args.pool, seed=args.seed)
    fmt = ChatGritFormat.from_loaded(loaded)
    tok = loaded.tokenizer
    train_passages = list(dict.fromkeys(split.gold[i] for i in split.train))
    def embed_rows(texts, instruction, max_len):  # the token ids GritEmbedder and the GRIT batches will use
        return [tokenize_for_embedding(tok, t, instruction, max_len=max_len, fmt=fmt) for t in texts]

    rows = {"train_q": embed_rows([split.questions[i] for i in split.train], args.instruction, args.query_len),
            "heldout_q": embed_rows([split.questions[i] for i in split.heldout], args.instruction, args.query_len),
            "train_p": embed_rows([split.texts[j] for j in train_passages], "", args.passage_len),
            "corpus": embed_rows([split.texts[j] for j in split.corpus], "", args.passage_len)}
    pairs = [(split.questions[i], answer_window(split.texts[split.gold[i]], split.answers[i][0],
                                                 args.gen_context_words)) for i in split.train[:args.gen_train]]
    targets = ([split.answers[i][0] for i in split.train[:args.gen_train]] if args.gen_targets == "gold"
               else base_targets(loaded, pairs, args))
    timer.stage("generative targets")
    keep = (complete_replies(tok, targets, args.max_new_tokens) if args.complete_targets and args.gen_targets == "base"
            else [True] * len(targets))
    gen_records = [{"text": [oracle_prompt(q, context), t]} for (q, context), t, k in zip(pairs, targets, keep)
                   if t.strip() and k]
    try:
        gen_rows = [tokenize_generative_record(r, tok, args.gen_len, fmt, i) for i, r in enumerate(gen_records)]
    except ValueError as e:  # a prompt longer than the row: name the flag that fixes it
        p.error(f"argument --gen-len: {args.gen_len} tokens is too short for a generative row ({e})")
    # Batches padded to the longest row of each kind, not to the caps (every padded token costs compute).
    longest = lambda group: max(len(ids) for ids, _ in group)  # noqa: E731
    data_cfg = GritDataConfig(embedding_batch_size=args.batch_size, generative_batch_size=args.gen_batch_size,
                              group_size=args.group_size, query_max_len=longest(rows["train_q"]),
                              passage_max_len=longest(rows["train_p"]),
                              generative_max_len=max(int(r["gen_attention_mask"].sum()) for r in gen_rows),
                              seed=args.seed)
    # Logits on each row's last `gen_window` tokens: from the token before its first target to its end.
    gen_window = max(int(r["gen_attention_mask"].sum() - np.flatnonzero(r["gen_loss_mask"]).min() + 1)
                     for r in gen_rows)
    print(f"NQ: {len(split.train)} training questions ({len(train_passages)} gold passages, {len(gen_rows)} "
          f"generative rows), {len(split.heldout)} held-out, corpus {len(split.corpus)} passages; "
          f"{args.model}: top {args.top_layers} of {loaded.config.num_layers} layers trained", flush=True)
    timer.stage("data")

    bottom, top = split_model(loaded.model, args.top_layers)
    n_bottom = loaded.config.num_layers - args.top_layers
    frozen = FrozenBottom(bottom, fingerprint=f"{loaded.source}|bottom={n_bottom}")
    cache = args.cache_dir / f"bottom{n_bottom}.npz"
    if cache.is_file():
        frozen.load(cache)
    before = len(frozen)
    for name, group in rows.items():
        frozen.precompute("bidirectional", [ids for ids, _ in group], desc=f"frozen bottom: {name}")
    frozen.precompute("causal", [r["gen_tokens"][:int(r["gen_attention_mask"].sum())] for r in gen_rows],
                      desc="frozen bottom: generative rows")
    if len(frozen) > before:
        cache.parent.mkdir(parents=True, exist_ok=True)
        frozen.save(cache)
    del bottom
    teacher = None
    if args.kl_factor and "unified" in modes:  # the base model's last residual on the generative rows
        base = FrozenBottom(loaded.model, fingerprint=f"{loaded.source}|teacher")
        path = args.cache_dir / "teacher.npz"
        if path.is_file():
            base.load(path)
        before = len(base)
        base.precompute("causal", [r["gen_tokens"][:int(r["gen_attention_mask"].sum())] for r in gen_rows],
                        desc="base model: generative rows")
        if len(base) > before:
            base.save(path)
        teacher = (base, top.final_norm)  # `top` keeps the base parameters (training copies them)
    timer.stage("frozen bottom")

    top_graphdef, base_params = nnx.split(top)
    heldout_gold = [split.corpus.index(split.gold[i]) for i in split.heldout]
    results: dict[str, dict] = {}

    def embed(params, questions: Sequence[int], passages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """GRIT embeddings (the top model on the cached bottom output) of questions and pool passages."""
        common = dict(fmt=fmt, inputs_embeds=lambda t, m: frozen.inputs_embeds("bidirectional", t, m))
        q = GritEmbedder((top_graphdef, params), tok, instruction=args.instruction, max_length=args.query_len,
                         **common).embed([split.questions[i] for i in questions])
        return q, GritEmbedder((top_graphdef, params), tok, max_length=args.passage_len,
                               **common).embed([split.texts[j] for j in passages])

    def evaluate(name: str, params) -> None:
        q, c = embed(params, split.heldout, split.corpus)
        results[name] = recall(q @ c.T, heldout_gold)
        print(f"  {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[name].items()), flush=True)
        results[name]["gold_rank"] = gold_ranks(q @ c.T, heldout_gold)

    evaluate("base", base_params)
    # Hard negatives mined with the base model among the training gold passages.
    q, c = embed(base_params, split.train, train_passages)
    pos = {j: n for n, j in enumerate(train_passages)}
    excluded = [{n for n, j in enumerate(train_passages) if best_subspan_em(split.texts[j], split.answers[i])}
                for i in split.train]
    negs = hard_negatives(q @ c.T, [pos[split.gold[i]] for i in split.train], excluded, args.negatives)
    emb_records = [{"query": [args.instruction, split.questions[i]], "pos": [split.texts[split.gold[i]]],
                    "neg": [split.texts[train_passages[n]] for n in neg]} for i, neg in zip(split.train, negs)]
    timer.stage("base retrieval")

    tuned = {}
    for mode in modes:
        tuned[mode], res = train_top(args, mode, top, frozen, emb_records, gen_records, tok, fmt, data_cfg,
                                     gen_window, teacher)
        evaluate(mode, tuned[mode])
        last = res.history[-1] if res.history else {}
        # Largest parameter change of the top model (a check that the evaluated model is the trained one).
        change = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))),
                              nnx.to_pure_dict(tuned[mode]), nnx.to_pure_dict(nnx.state(top, nnx.Param)))
        results[mode]["max_param_change"] = max(jax.tree.leaves(change))
        print(f"  {mode}: max |parameter change| {results[mode]['max_param_change']:.2e}", flush=True)
        results[mode].update(train_s=last.get("elapsed_s", float("nan")), step_s=last.get("step_time_s", float("nan")),
                             **{k: last[k] for k in ("loss_rep", "loss_gen", "loss_kl", "rep_accuracy") if k in last})
        timer.stage(f"train {mode}")

    if not args.no_minilm:
        minilm = BertEmbedder()
        qv = embed_texts(minilm, [split.questions[i] for i in split.heldout], desc="MiniLM questions")
        cv = embed_texts(minilm, [split.texts[j] for j in split.corpus], desc="MiniLM passages")
        results["minilm"] = recall(qv @ cv.T, heldout_gold)
        results["minilm"]["gold_rank"] = gold_ranks(qv @ cv.T, heldout_gold)
        timer.stage("minilm")

    em_questions = split.heldout[:args.em_questions]
    for name in ["base", *(["unified"] if "unified" in modes else [])] if em_questions else []:
        model = loaded.model if name == "base" else merge_top(loaded.model, tuned[name])
        preds = answers(loaded, model, [(split.questions[i], split.texts[split.gold[i]]) for i in em_questions], args)
        results[name]["oracle_em"] = float(np.mean([best_subspan_em(pr, split.answers[i])
                                                    for pr, i in zip(preds, em_questions)]))
        results[name]["predictions"] = preds
        print(f"  {name}: oracle best-subspan EM {results[name]['oracle_em']:.3f} ({len(em_questions)} questions)",
              flush=True)
        timer.stage(f"EM {name}")

    cols = [f"recall@{k}" for k in KS] + ["oracle_em"]
    print(f"\n# GRIT on {args.model}: {len(split.heldout)} held-out NQ questions, corpus {len(split.corpus)} passages "
          f"(SmolLM2: first {args.passage_len} tokens; MiniLM: 256), oracle EM on {len(em_questions)}")
    print(table(["model", *cols], [[n, *(r.get(c, "-") for c in cols)] for n, r in results.items()]))
    if {"unified", "embedding"} <= set(results):
        u, e, b = results["unified"], results["embedding"], results["base"]
        only_u, only_e, pval = discordant(u["gold_rank"], e["gold_rank"], 5)
        print(f"unified - embedding-only recall@5: {100 * (u['recall@5'] - e['recall@5']):+.1f} points ({only_u} "
              f"questions only unified hits, {only_e} only embedding-only, exact McNemar p={pval:.2f}); "
              f"unified - base recall@5: {100 * (u['recall@5'] - b['recall@5']):+.1f}")
    if "oracle_em" in results.get("unified", {}):
        print(f"unified - base oracle EM: {100 * (results['unified']['oracle_em'] - results['base']['oracle_em']):+.1f}"
              " points")
    print("stages (wall s): " + ", ".join(f"{k} {v:.0f}" for k, v in timer.wall.items()))
    if args.out is not None:
        write_text(args.out, json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "stages_s": timer.wall}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
