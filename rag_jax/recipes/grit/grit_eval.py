"""Small-scale GRIT: unified vs embedding-only vs generation-only models trained with the same steps.

GritLM (ICLR 2025, §3, Table 1 direction: the unified model matches each single-objective model on
its own task). Data: Natural Questions (open) with gold passages (``shared/data/lost_in_the_middle/
nq-open-oracle.jsonl.gz``):
- embedding triples: query = [instruction, question], positive = its gold passage, hard negative =
  the other passage with the largest word overlap among ``--negative_candidates`` random ones;
- generative pairs: ``[passage window around the answer + question, answer]`` (reading comprehension;
  loss on the answer).
Held-out questions are the test set. Each model starts from the same random init (same seed) and
trains ``steps`` steps with the same data order through the one trainer (``rag_jax.train.trainer.run``)
and ``GritLoss``.

Reported: retrieval recall@k of held-out questions over a corpus of passages (their gold passages
plus distractors) with the model in GRIT embedding mode (``GritEmbedder``; queries with the
instruction, passages without), pretrained MiniLM (``BertEmbedder``) on the same corpus as a
reference, and teacher-forced generation loss / next-token accuracy on held-out answers.

    rag-jax eval grit_eval       # CPU default (train/configs/grit_cpu.yaml): ~20 min on 2 busy CPU cores
    rag-jax eval grit_eval --config train/configs/grit_tiny.yaml --no_minilm   # smoke run, ~2 min
    rag-jax eval grit_eval train.steps=400 data.embedding_batch_size=32               # key=value overrides
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from rag_jax import config as config_lib
from rag_jax import sharding
from rag_jax.atomic import write_text
from rag_jax.data.grit import GritDataConfig, grit_batches, tokenize_generative_record
from rag_jax.data.loaders import NQ_ORACLE, load_nq_oracle, shared_file
from rag_jax.args import ScriptParser, input_file, names, output_file
from rag_jax.evaluation.tables import table
from rag_jax.metrics import recall_of_scores
from rag_jax.model import ModelConfig
from rag_jax.model.embedding import GritEmbedder
from rag_jax.retrieval.embedders import BertEmbedder
from rag_jax.tokenizer import train_bpe
from rag_jax.train import optim, trainer
from rag_jax.train.objectives.grit import GritConfig, GritLoss

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "train" / "configs" / "grit_cpu.yaml"
MODES = ("unified", "embedding", "generative")


@dataclasses.dataclass(frozen=True)
class GritRunConfig:
    """A GRIT run (``train/configs/grit*.yaml``).

    Attributes:
      model, mesh, optimizer: as the project's training runs.
      grit: the objective (``GritConfig``); its ``mode`` is overridden per compared model.
      data: batch sizes / max lengths of the two streams (``GritDataConfig``).
      train: the one trainer's section (``trainer.TrainConfig``): ``steps`` per model, ``seed`` (init, data order
        and split), ``precision``, ``remat_policy``, ``log_every``.
      instruction: the query instruction (documents get none, notes §2).
      train_questions / eval_questions: NQ questions used for training / held out.
      corpus_size: passages searched at evaluation (the held-out gold ones plus distractors).
      negative_candidates: random passages scanned for each query's lexical hard negative.
      generative_context_words: passage words around the answer in a generative sample.
      recall_k: cut-offs of recall@k.
      tokenizer_vocab: BPE vocabulary trained on the data (<= model.vocab_size).
    """

    model: ModelConfig = ModelConfig(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=2,
                                     num_heads=4, num_kv_heads=2, max_seq_len=512)
    mesh: sharding.MeshConfig = sharding.MeshConfig(data=1, fsdp=-1, tensor=1)
    optimizer: optim.OptimizerConfig = optim.OptimizerConfig(learning_rate=3e-4, warmup_steps=20, weight_decay=0.0)
    grit: GritConfig = GritConfig()
    data: GritDataConfig = GritDataConfig(embedding_batch_size=16, generative_batch_size=8, group_size=2,
                                          query_max_len=40, passage_max_len=64, generative_max_len=256)
    train: trainer.TrainConfig = trainer.TrainConfig(steps=400, log_every=25)
    instruction: str = "Retrieve the Wikipedia passage that answers the question"
    train_questions: int = 2000
    eval_questions: int = 200
    corpus_size: int = 600
    negative_candidates: int = 64
    generative_context_words: int = 48
    recall_k: tuple[int, ...] = (1, 5, 10)
    tokenizer_vocab: int = 2048

    def __post_init__(self):
        if self.tokenizer_vocab > self.model.vocab_size:
            raise ValueError(f"tokenizer_vocab={self.tokenizer_vocab} exceeds model.vocab_size={self.model.vocab_size}")
        if self.eval_questions < 1 or self.train_questions < 1:
            raise ValueError("train_questions and eval_questions must be >= 1")
        trainer.refuse_set_fields(self.train, {"global_batch_size": "grit_eval's batches are the data section's",
                                               "objective": "grit_eval's objective is the grit section",
                                               "run_dir": "grit_eval writes no run folder"})
        if self.corpus_size < self.eval_questions:
            raise ValueError(f"corpus_size={self.corpus_size} must be >= eval_questions={self.eval_questions}")


def load_nq(path: Path | None = None) -> list[dict]:
    """NQ-open oracle rows (``rag_jax.data.loaders.load_nq_oracle``) -> ``[{"question", "answers", "passage"}]``
    (passage = gold title + text).

    Raises:
      FileNotFoundError: the shared data file is absent.
    """
    return [{"question": ex.question, "answers": list(ex.answers), "passage": f"{ex.gold.title} {ex.gold.text}".strip()}
            for ex in load_nq_oracle(path or shared_file(*NQ_ORACLE))]


def answer_window(passage: str, answer: str, words: int) -> str:
    """``words`` words of the passage around the first mention of the answer (the start if absent), so
    generative samples fit ``generative_max_len`` and still contain the answer."""
    tokens = passage.split()
    hit = passage.lower().find(answer.lower())
    center = len(passage[:hit].split()) if hit >= 0 else 0
    start = max(0, min(center - words // 2, len(tokens) - words))
    return " ".join(tokens[start:start + words])


def _gen_record(cfg: "GritRunConfig", row: dict) -> dict:
    context = answer_window(row["passage"], row["answers"][0], cfg.generative_context_words)
    return {"text": [f"{context}\n\nQuestion: {row['question']}", row["answers"][0]]}


def build_data(cfg: GritRunConfig, rows: list[dict]):
    """Split and format: (embedding records, generative records, eval rows, corpus, gold corpus ids)."""
    rng = np.random.default_rng(cfg.train.seed)
    rows = [rows[i] for i in rng.permutation(len(rows))]
    test, train = rows[:cfg.eval_questions], rows[cfg.eval_questions:cfg.eval_questions + cfg.train_questions]
    passages = list(dict.fromkeys(r["passage"] for r in rows))
    words = [set(p.lower().split()) for p in passages]
    index = {p: i for i, p in enumerate(passages)}
    emb, gen = [], []
    for r in train:
        gold = index[r["passage"]]
        q = set(r["question"].lower().split())
        cands = [c for c in rng.choice(len(passages), cfg.negative_candidates, replace=False) if c != gold]
        hard = max(cands, key=lambda c: len(q & words[c]))
        emb.append({"query": [cfg.instruction, r["question"]], "pos": [r["passage"]], "neg": [passages[hard]]})
        gen.append(_gen_record(cfg, r))
    test_passages = list(dict.fromkeys(r["passage"] for r in test))
    others = [p for p in passages if p not in set(test_passages)]
    extra = [others[i] for i in rng.choice(len(others), cfg.corpus_size - len(test_passages), replace=False)]
    corpus = test_passages + extra
    cid = {p: i for i, p in enumerate(corpus)}
    gold_ids = np.asarray([cid[r["passage"]] for r in test])
    test_gen = [_gen_record(cfg, r) for r in test]
    return emb, gen, test, test_gen, corpus, gold_ids


def fits(records: list[dict], tokenizer, cfg: GritRunConfig) -> list[dict]:
    """The generative records whose answer fits ``generative_max_len`` (the rest are dropped, as the
    reference drops samples whose prefix fills the max length)."""
    kept = []
    for r in records:
        try:
            tokenize_generative_record(r, tokenizer, cfg.data.generative_max_len)
            kept.append(r)
        except ValueError:
            pass
    return kept


def train_tokenizer(cfg: GritRunConfig, rows: list[dict]):
    texts = [r["question"] for r in rows] + [r["passage"] for r in rows] + [a for r in rows for a in r["answers"]]
    texts += [f"<|user|>\n{cfg.instruction}\n<|embed|>\n<|assistant|>\n"] * 50
    return train_bpe(texts, cfg.tokenizer_vocab, special_tokens=("<pad>", "<s>", "</s>", "<unk>"))


def train_model(cfg: GritRunConfig, mode: str, emb_records, gen_records, tokenizer):
    """Train one model in GRIT ``mode`` for ``cfg.train.steps`` steps with the one trainer -> ``(graphdef, params)``."""
    mesh = sharding.make_mesh(cfg.mesh)
    loss_fn = GritLoss(dataclasses.replace(cfg.grit, mode=mode), mesh=mesh)
    batches = grit_batches(emb_records if mode != "generative" else None,
                           gen_records if mode != "embedding" else None, tokenizer, cfg.data)
    run_cfg = trainer.RunConfig(model=cfg.model, mesh=cfg.mesh, optimizer=cfg.optimizer,
                                train=cfg.train)
    task = trainer.Task(loss_fn, lambda step: next(batches), name=f"GRIT {mode}",
                        progress_keys=("loss_rep", "loss_gen", "rep_accuracy"))
    result = trainer.run(run_cfg, task, mesh=mesh)
    return result.graphdef, result.state.params


def generation_metrics(cfg: GritRunConfig, graphdef, params, tokenizer, records) -> tuple[float, float]:
    """Teacher-forced loss (nats/token) and next-token accuracy on held-out answers."""
    from flax import nnx

    data_cfg = dataclasses.replace(cfg.data, generative_batch_size=min(cfg.data.generative_batch_size, len(records)))
    batches = grit_batches(None, records, tokenizer, data_cfg)
    loss_fn = GritLoss(GritConfig(mode="generative", loss_gen_type="token"))
    evaluate = jax.jit(lambda p, b: loss_fn(nnx.merge(graphdef, p), b)[1])
    n_batches = len(records) // data_cfg.generative_batch_size
    tot_loss = tot_correct = tot_tokens = 0.0
    for _ in range(n_batches):
        batch = next(batches)
        m = jax.device_get(evaluate(params, batch))
        n_tok = float(batch["gen_loss_mask"][:, 1:].sum())
        tot_loss += float(m["loss_gen"]) * batch["gen_tokens"].shape[0]  # "token": sum / B
        tot_correct += float(m["gen_accuracy"]) * n_tok
        tot_tokens += n_tok
    return tot_loss / tot_tokens, tot_correct / tot_tokens


def main(argv=None) -> int:
    parser = ScriptParser(prog="rag-jax eval grit_eval", description=__doc__)
    parser.add_argument("--config", type=input_file, default=str(DEFAULT_CONFIG), help="YAML preset")
    parser.add_argument("--modes", type=names(MODES), default=",".join(MODES),
                        help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--no_minilm", action="store_true", help="skip the pretrained MiniLM reference")
    parser.add_argument("--json", type=output_file, default=None, help="write the results table here as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=200 data.group_size=1")
    args = parser.parse_args(argv)
    cfg = config_lib.load_config(GritRunConfig, args.config, args.overrides)
    modes = args.modes

    rows = load_nq()
    emb, gen, test, test_gen, corpus, gold = build_data(cfg, rows)
    tokenizer = train_tokenizer(cfg, rows)
    gen, test_gen = fits(gen, tokenizer, cfg), fits(test_gen, tokenizer, cfg)
    print(f"NQ: {len(emb)} train triples, {len(gen)} train pairs, {len(test)} held-out questions "
          f"({len(test_gen)} pairs), corpus {len(corpus)} passages; {cfg.train.steps} steps; backend "
          f"{jax.default_backend()} x{jax.device_count()}", flush=True)
    questions = [r["question"] for r in test]
    results = {}
    for mode in modes:
        graphdef, params = train_model(cfg, mode, emb, gen, tokenizer)
        embedder = GritEmbedder((graphdef, params), tokenizer, instruction=cfg.instruction,
                                max_length=cfg.data.passage_max_len, batch_size=32)
        recall = recall_of_scores(embedder.embed(questions) @ embedder.embed(corpus, instruction="").T, gold,
                                  cfg.recall_k)
        loss, acc = generation_metrics(cfg, graphdef, params, tokenizer, test_gen)
        results[mode] = {**{f"recall@{k}": v for k, v in recall.items()}, "gen_loss": loss, "gen_accuracy": acc}
    if not args.no_minilm:
        minilm = BertEmbedder(max_length=cfg.data.passage_max_len)
        recall = recall_of_scores(minilm.embed(questions) @ minilm.embed(corpus).T, gold, cfg.recall_k)
        results["minilm (pretrained)"] = {f"recall@{k}": v for k, v in recall.items()}

    cols = [f"recall@{k}" for k in cfg.recall_k] + ["gen_loss", "gen_accuracy"]
    print("\n" + table(["model", *cols], [[name, *(r.get(c, "-") for c in cols)] for name, r in results.items()]))
    if "unified" in results:
        u = results["unified"]
        print("\nunified minus single-objective (points; goal: within 1 point):")
        if "embedding" in results:
            print("  retrieval " + ", ".join(f"{c}: {100 * (u[c] - results['embedding'][c]):+.1f}" for c in cols[:-2]))
        if "generative" in results:
            print(f"  generation accuracy: {100 * (u['gen_accuracy'] - results['generative']['gen_accuracy']):+.1f}, "
                  f"loss: {u['gen_loss'] - results['generative']['gen_loss']:+.3f} nats")
    if args.json:
        write_text(args.json, json.dumps({"config": config_lib.to_dict(cfg), "results": results}, indent=1))
    return 0
