"""``rag-jax demo``: the whole framework end to end on a fictional universe, in minutes on a laptop CPU.

This module is orchestration and the report; every stage is a component of the library:

1. **Data** (``rag_jax.data.phantom_rag``): a generated PhantomWiki-style training universe and a held-out
   one, or a PhantomWiki folder (``--data``); articles cut into section passages; 1-hop attribute questions
   by default (the answer is a span of the person's article: a reader copies it, and cannot guess it).
2. **Base model and tokenizer**: the packaged reader base ``demo_reader`` (``rag_jax/assets/``, made by
   ``train/pretrain_reader.py`` on universes the demo never uses), as GritLM and Block-Attention start from
   pretrained LMs; ``base: <folder>`` takes any HF-format folder with ``tokenizer.json``; ``base: null``
   trains a BPE tokenizer and a random ``model`` from scratch (the GPU config does).
3. **Training** with the one trainer (``rag_jax.train.trainer.run``) on the GRIT + Block-Attention objective
   (``rag_jax.train.objectives.grit_block``: GritLM Eq. 3 with the Block-Attention loss as ``L_Gen``) over
   ``RagTrainingSet`` batches; the output folder is a run folder (``rag_jax.train.run_folder``).
4. **Retrieval** (``rag_jax.evaluation.rag.retrieval_eval``): held-out passages embedded with pretrained
   MiniLM and with the trained model in GRIT embedding mode, each into a ScaNN index; recall@k / hit@k.
5. **Answers** to held-out questions (greedy): without retrieval; top-k retrieved passages under full
   attention; the same under Block-Attention with passage KV reuse; gold passage(s) forced into the top k.
6. **TTFT** of full prefill vs Block-Attention with warm passage caches, by prompt length.
7. **Report**: ``metrics.json``, ``loss.png``, ``ttft.png``, and the run folder files (``config.yaml``,
   ``tokenizer.json``, ``metrics.jsonl``, TensorBoard, orbax ``checkpoints/``) in the output folder.

Configuration: :class:`DemoConfig` (defaults = the CPU demo), a YAML file (``--config``, e.g.
``train/configs/demo_gpu.yaml``) and ``key=value`` overrides, loaded by ``rag_jax.config.load_config``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rag_jax import config as config_lib
from rag_jax.data.phantom_rag import (BOS, EOS, PAD, TaskConfig, UniverseConfig, answer_text, question_block,
                                      rag_example)
from rag_jax.evaluation.tables import table
from rag_jax.model.config import ModelConfig
from rag_jax.retrieval.scann_index import ScannConfig
from rag_jax.sharding import MeshConfig
from rag_jax.train.optim import OptimizerConfig

__all__ = ["DemoConfig", "load_demo_config", "run", "main"]

DEFAULT_BASE = "demo_reader"
ASSETS = Path(__file__).resolve().parent / "assets"
RETRIEVERS = ("grit", "minilm")

# Defaults of the sections whose dataclass defaults are not the demo's (a YAML/override that sets one
# field of these sections keeps the other demo defaults; ``model.preset`` replaces the model defaults).
DEMO_MODEL = dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=1024)
DEMO_OPTIMIZER = dict(learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, min_lr_ratio=0.1)


# ---------------------------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Attributes: vocab_size: BPE vocabulary (>= 260); the model's ``vocab_size`` is set from it."""

    vocab_size: int = 1024


@dataclasses.dataclass(frozen=True)
class DemoTrainConfig:
    """Joint GRIT + Block-Attention training.

    Attributes:
      steps: optimizer steps.
      rag_batch_size: RAG prompts per step (Block-Attention loss, both modes).
      embedding_batch_size: GRIT queries per step (in-batch negatives + hard negatives).
      group_size: GRIT passages per query (1 positive + group_size - 1 hard negatives).
      seq_len: padded RAG row length in tokens; 0 = from the data (k passages of 90th-percentile length).
      query_max_len / passage_max_len: GRIT token limits incl. the format prefix; 0 = from the data
        (the longest training query; the 90th-percentile passage).
      lm_weight: next-token loss weight of passage tokens (answer tokens weigh 1, question tokens 0).
      max_turns: questions per RAG row (1 = only the inference layout; see ``_TrainingData``).
      full_weight / block_weight: Block-Attention loss weights of the full and block passes.
      gen_weight: λ_Gen of GRIT Eq. 3 (weight of the Block-Attention loss against L_Rep).
      grit_temperature: InfoNCE temperature (GritLM: 0.02; 0.05 trains more stably from scratch).
      grit_instruction: query instruction in GRIT embedding mode (documents get none).
      precision: ``fp32`` | ``bf16`` | ``bf16_pure`` (``rag_jax.train.step.apply_precision``).
      seed: init, data order and distractor sampling.
      devices: devices of the training mesh; 0 = 1 on CPU (fake CPU devices do not add compute),
        all devices on GPU/TPU.
      log_every: steps between loss-curve points.
    """

    steps: int = 200
    rag_batch_size: int = 8
    embedding_batch_size: int = 8
    group_size: int = 2
    seq_len: int = 0
    query_max_len: int = 0
    passage_max_len: int = 0
    lm_weight: float = 0.2
    max_turns: int = 6
    full_weight: float = 1.0
    block_weight: float = 1.0
    gen_weight: float = 1.0
    grit_temperature: float = 0.05
    grit_instruction: str = "Find the article that answers the question"
    precision: str = "fp32"
    seed: int = 0
    devices: int = 0
    log_every: int = 1

    def __post_init__(self):
        for name in ("steps", "rag_batch_size", "embedding_batch_size", "group_size", "log_every", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        for name in ("seq_len", "query_max_len", "passage_max_len", "devices"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 0 (0 = automatic)")
        for name in ("lm_weight", "full_weight", "block_weight", "gen_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """Attributes:
      retriever: the index that feeds the answering prompts: ``grit`` (the trained model) or ``minilm``.
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


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Attributes:
      max_questions: held-out questions answered (the first ones of the held-out set).
      max_new_tokens: cap on generated answer tokens (the longest training answer + 2 is used below it).
      batch_size: prompts per generation call.
      ttft_passages: passages per prompt for the TTFT curve (sizes that exceed max_seq_len are skipped).
      ttft_repeats: timed runs per point (median reported, after one warm-up run).
    """

    max_questions: int = 100
    max_new_tokens: int = 32
    batch_size: int = 128
    ttft_passages: tuple[int, ...] = (1, 2, 4, 6)
    ttft_repeats: int = 5

    def __post_init__(self):
        for name in ("max_questions", "max_new_tokens", "batch_size", "ttft_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 1")
        if any(n < 1 for n in self.ttft_passages):
            raise ValueError(f"eval.ttft_passages={self.ttft_passages!r} must be ints >= 1 (may be empty)")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The whole demo (sections above; ``model`` is a ``ModelConfig`` whose ``vocab_size`` is replaced
    by the trained tokenizer's, ``optimizer`` an ``OptimizerConfig``, ``mesh`` a ``MeshConfig``).

    ``base``: the model to fine-tune (module docstring, stage 2): the name of a packaged base
    (``demo_reader``, in ``rag_jax/assets/``), or a path to an HF-format folder (``config.json``,
    ``*.safetensors``, ``tokenizer.json``); ``None`` (``base: null``) trains the tokenizer and a random
    ``model`` from scratch. With a base, the ``model`` and ``tokenizer`` sections must not be set (the base
    fixes both)."""

    base: str | None = DEFAULT_BASE

    universe: UniverseConfig = dataclasses.field(default_factory=UniverseConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEMO_MODEL))
    optimizer: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig(**DEMO_OPTIMIZER))
    train: DemoTrainConfig = dataclasses.field(default_factory=DemoTrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


    def __post_init__(self):
        fixed = [name for name, default in (("model", ModelConfig(**DEMO_MODEL)), ("tokenizer", TokenizerConfig()))
                 if getattr(self, name) != default]
        if self.base is not None and fixed:
            raise config_lib.ConfigError(
                f"{' and '.join(fixed)} section(s) set while base={self.base!r}: the base model fixes the "
                "architecture and tokenizer; remove them, or set base=null to train a tokenizer and model from scratch")


def _demo_defaults(user: dict) -> dict:
    model = user.get("model")
    preset = isinstance(model, dict) and "preset" in model
    return {"optimizer": dict(DEMO_OPTIMIZER), **({} if preset else {"model": dict(DEMO_MODEL)})}


def load_demo_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> DemoConfig:
    """Demo defaults <- YAML file <- ``key=value`` overrides (``rag_jax.config.load_config``).

    Raises:
      rag_jax.config.ConfigError (a ValueError): missing/invalid YAML, unknown key (with the closest
        valid one), wrong type, key set twice, a section's own validation error, or ``model`` /
        ``tokenizer`` set while a ``base`` fixes them.
    """
    return config_lib.load_config(DemoConfig, path, list(overrides), defaults=_demo_defaults)


def resolve_base(base: str) -> Path:
    """The folder of ``DemoConfig.base``: a packaged base name (``rag_jax/assets/<name>``) or a path.

    Raises:
      FileNotFoundError: no such folder, or it lacks ``config.json``, a ``*.safetensors`` file or
        ``tokenizer.json``.
    """
    path = ASSETS / base if (ASSETS / base).is_dir() and "/" not in base else Path(base)
    packaged = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
    if not path.is_dir():
        raise FileNotFoundError(f"base={base!r}: no such folder; use a packaged base {packaged}, an HF-format "
                                "folder with tokenizer.json, or base=null (train from scratch)")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(f"base={base!r} ({path}) lacks {missing}; an HF-format folder with "
                                "tokenizer.json is needed")
    return path



# ---------------------------------------------------------------------------------------------
# Report.

def _plots(history: list[dict], ttft: list[dict], out: Path) -> dict[str, str]:
    from matplotlib.figure import Figure  # no pyplot: no global backend state (works in notebooks too)

    files = {}
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    steps = [h["step"] for h in history]
    for key, label in (("loss", "total (L_Rep + λ·L_Gen)"), ("loss_rep", "GRIT L_Rep (contrastive)"),
                       ("loss_full", "Block-Attention loss, full pass"), ("loss_block", "Block-Attention loss, block pass")):
        ax.plot(steps, [h[key] for h in history], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title("rag-jax demo: training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    files["loss_plot"] = str(out / "loss.png")
    if ttft:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        x = [r["prompt_tokens"] for r in ttft]
        ax.plot(x, [r["full_ms"] for r in ttft], "o-", label="full prefill")
        ax.plot(x, [r["cached_ms"] for r in ttft], "o-", label="Block-Attention, cached passages")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("time to first token (ms, median)")
        ax.set_title("TTFT vs prompt length")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ttft.png", dpi=110)
        files["ttft_plot"] = str(out / "ttft.png")
    return files



CONDITION_LABELS = {
    "no_retrieval": "no retrieval (question only)",
    "retrieval_full": "retrieved top-{k}, full attention",
    "retrieval_block": "retrieved top-{k}, Block-Attention (KV reuse)",
    "oracle_block": "gold passage(s) in top-{k}, Block-Attention",
}


def format_report(report: dict) -> str:
    """The human-readable report printed at the end of a run."""
    d, tr, qa = report["data"], report["train"], report["qa"]
    k = qa["num_passages"]
    ks = report["config"]["retrieval"]["ks"]
    lines = ["", "=" * 78, "rag-jax demo report", "=" * 78,
             f"data: {d['source']}",
             f"task: {d['question_kind']} questions; {d['train_questions']} train / {d['eval_questions']} held-out; "
             f"articles cut into section passages: {d['train_passages']} train / {d['eval_passages']} held-out",
             f"model: {report['model']['num_layers']} layers, hidden {report['model']['hidden_size']}, "
             f"{report['model']['params'] / 1e6:.2f}M params, vocab {report['model']['vocab_size']}; "
             + (f"fine-tuned from base {report['model']['base']}" if report['model'].get('base') else "from scratch"),
             f"training: {tr['steps']} steps in {tr['seconds']:.0f} s (+{tr['compile_seconds']:.0f} s compile); final "
             f"loss {tr['final']['loss']:.3f}, GRIT in-batch top-1 {tr['final']['rep_accuracy']:.2f}, "
             f"next-token accuracy (loss-weighted) {tr['final']['gen_accuracy']:.2f}", ""]
    rows = [[r["retriever"], *[r[f"recall@{c}"] for c in ks], *[r[f"hit@{c}"] for c in ks]]
            for r in report["retrieval"].values()]
    lines += [f"retrieval of gold passages among {d['eval_passages']} held-out passages (ScaNN), "
              f"{d['eval_questions']} questions:",
              table(["embedder", *[f"recall@{c}" for c in ks], *[f"hit@{c}" for c in ks]], rows), ""]
    rows = [[CONDITION_LABELS[c].format(k=k), v["set_em"], v["set_f1"], v["f1"], v["seconds"]]
            for c, v in qa["conditions"].items()]
    lines += [f"answers to {qa['num_questions']} held-out questions (retriever: {qa['retriever']}; greedy):",
              table(["condition", "EM", "set-F1", "token-F1", "seconds"], rows)]
    kv = qa.get("kv_store")
    if kv:
        lines.append(f"passage KV store: {kv['entries']} cached blocks ({kv['bytes'] / 2**20:.1f} MiB), "
                     f"{kv['hits']} hits / {kv['misses']} misses")
    if report["ttft"]:
        rows = [[r["passages"], r["prompt_tokens"], r["full_ms"], r["cached_ms"], r["speedup"]] for r in report["ttft"]]
        lines += ["", "time to first token (ms, median; cached = Block-Attention with warm passage KV):",
                  table(["passages", "tokens", "full ms", "cached ms", "speedup"], rows)]
    if qa.get("examples"):
        lines += ["", "examples (held-out):"]
        for ex in qa["examples"]:
            lines.append(f"  Q: {ex['question']}  gold: {answer_text(ex['gold'])}")
            lines.append(f"     no retrieval: {ex['no_retrieval']!r}   with retrieval (block): {ex['retrieval_block']!r}")
    lines += ["", "files: " + ", ".join(f"{k}={v}" for k, v in report["files"].items()),
              f"total: {report['total_seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU; stages (wall/CPU s): "
              + ", ".join(f"{k} {v:.0f}/{report['cpu_timings'][k]:.0f}" for k, v in report["timings"].items()),
              "=" * 78]
    return "\n".join(lines)




# ---------------------------------------------------------------------------------------------
# The job.

def check_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and check a file can be written there (before any compute).

    Raises:
      PermissionError: the folder cannot be created or written (the message says why).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"output directory {str(path)!r} is not writable ({e.strerror or e}); "
                              "pass --out with a writable folder") from None
    return path



def _mesh(cfg: DemoConfig):
    import jax

    from rag_jax import sharding
    devices = jax.devices()
    n = cfg.train.devices or (1 if devices[0].platform == "cpu" else len(devices))
    if n > len(devices):
        raise ValueError(f"train.devices={n} but only {len(devices)} devices are available")
    return sharding.make_mesh(cfg.mesh, devices=devices[:n])


def _base_model(cfg: DemoConfig, base_dir: Path | None, data, fmt):
    """``(tokenizer, model config, initial params or None)`` (module docstring, stage 2)."""
    if base_dir is None:
        from rag_jax.data.tokenizer import train_bpe
        # The prompt and GRIT format strings are in every input: let BPE learn them as a few tokens.
        texts = ([p["text"] for p in data.train_passages] + [q["question"] for q in data.train_questions]
                 + [question_block("") + " " + answer_text(q["answer"]) for q in data.train_questions]
                 + [fmt.embed_prefix(cfg.train.grit_instruction), fmt.embed_prefix("")] * 8)
        tokenizer = train_bpe(texts, cfg.tokenizer.vocab_size, special_tokens=(PAD, BOS, EOS, "<unk>"))
        vocab = -(-tokenizer.get_vocab_size() // 64) * 64  # a multiple of 64: friendlier matmul shapes
        return tokenizer, cfg.model.replace(vocab_size=vocab), None
    from flax import nnx

    from rag_jax.data.tokenizer import load_tokenizer
    from rag_jax.model.hf import load_hf
    tokenizer = load_tokenizer(base_dir / "tokenizer.json")
    missing = [t for t in (PAD, BOS, EOS) if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"base={cfg.base!r}: tokenizer.json lacks the special tokens {missing} the demo's "
                         "prompts use")
    model_cfg, base_model, _ = load_hf(base_dir, dtype="float32")
    return tokenizer, model_cfg, nnx.split(base_model)[1]


def _train(cfg: DemoConfig, model_cfg: ModelConfig, td, tokenizer, mesh, out: Path, progress: bool, init_params):
    """Stage 3 through the one trainer; the output folder is the run folder."""
    from rag_jax import sharding
    from rag_jax.train import trainer
    from rag_jax.train.checkpoint import CheckpointConfig
    from rag_jax.train.objectives.block import BlockLoss
    from rag_jax.train.objectives.grit import GritConfig, GritLoss
    from rag_jax.train.objectives.grit_block import GritBlockLoss

    tc = cfg.train
    for name, size in (("rag_batch_size", tc.rag_batch_size), ("embedding_batch_size", tc.embedding_batch_size)):
        try:
            sharding.check_global_batch(size, mesh)
        except ValueError as e:
            raise ValueError(f"train.{name}: {e}") from None
    loss_fn = GritBlockLoss(GritLoss(GritConfig(mode="embedding", temperature=tc.grit_temperature)),
                            BlockLoss(full_weight=tc.full_weight, block_weight=tc.block_weight), tc.gen_weight)
    run_cfg = trainer.RunConfig(
        model=model_cfg, mesh=cfg.mesh, optimizer=cfg.optimizer,
        train=trainer.TrainConfig(steps=tc.steps, seed=tc.seed, precision=tc.precision, log_every=tc.log_every,
                                  run_dir=str(out)),
        checkpoint=CheckpointConfig(save_every=tc.steps, keep=1, async_save=False),
        logging=trainer.LoggingConfig(progress_bar=progress))
    task = trainer.Task(loss_fn, td.batch, name="training (GRIT + Block-Attention)", tokenizer=tokenizer,
                        progress_keys=("rep_accuracy", "gen_accuracy"))
    sections = {k: config_lib.to_dict(getattr(cfg, k)) for k in ("universe", "task", "retrieval", "eval")}
    sections["grit"] = {"instruction": tc.grit_instruction, "passage_max_len": td.passage_max_len}  # for eval scripts
    return trainer.run(run_cfg, task, init_params=init_params, mesh=mesh, extra_config=sections)


def run(cfg: DemoConfig, *, data_path: str | os.PathLike | None = None, out_dir: str | os.PathLike = "runs/demo",
        progress: bool = True, log=print) -> dict:
    """Run the demo (module docstring) and return the report dict (also written to ``metrics.json``).

    Raises:
      PermissionError: ``out_dir`` is not writable. FileNotFoundError / ValueError: a missing or malformed
      ``data_path``, too few questions, or a missing MiniLM package while ``retrieval.retriever=minilm``.
      All are raised before any training.
    """
    from rag_jax.data.phantom_rag import RagTrainingSet, grit_format, prepare_data
    from rag_jax.evaluation.timing import StageTimer
    from rag_jax.retrieval.embedders import minilm_dir

    timer = StageTimer()
    out = check_output_dir(out_dir)
    base_dir = resolve_base(cfg.base) if cfg.base is not None else None
    try:
        minilm_dir()
        have_minilm = True
    except FileNotFoundError:
        if cfg.retrieval.retriever == "minilm":
            raise
        have_minilm = False

    log(f"[1/7] data: {'loading ' + str(data_path) if data_path else 'generating universes'}")
    data = prepare_data(cfg.universe, cfg.task, data_path)
    timer.stage("data")

    import jax

    from rag_jax.model import count_params

    fmt = grit_format()
    log(f"[2/7] base model and tokenizer: {cfg.base} ({base_dir})" if base_dir else
        f"[2/7] tokenizer: byte-level BPE, vocab {cfg.tokenizer.vocab_size}; model from scratch")
    tokenizer, model_cfg, init_params = _base_model(cfg, base_dir, data, fmt)
    td = RagTrainingSet(data, tokenizer, fmt, cfg.train, cfg.task.num_passages)
    if td.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"train.seq_len={td.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; raise "
                         "model.max_seq_len or lower task.num_passages")
    timer.stage("tokenizer")

    mesh = _mesh(cfg)
    params = count_params(model_cfg)
    log(f"[3/7] training: {params / 1e6:.2f}M-param model ({'fine-tuning ' + cfg.base if cfg.base else 'from scratch'}"
        f"), {cfg.train.steps} steps, GRIT (contrastive, {cfg.train.embedding_batch_size} queries x "
        f"{cfg.train.group_size} passages) + Block-Attention ({cfg.train.rag_batch_size} prompts x {td.seq_len} "
        f"tokens, full + block passes) on {mesh.size} device(s); run folder {out}")
    result = _train(cfg, model_cfg, td, tokenizer, mesh, out, progress, init_params)
    model = (result.graphdef, result.state.params)
    timer.stage("train")
    # The resolved config: the model actually trained and the data-sized lengths (config.yaml holds the same).
    resolved = dataclasses.replace(cfg, base=None, model=model_cfg, train=dataclasses.replace(
        cfg.train, seq_len=td.seq_len, query_max_len=td.query_max_len, passage_max_len=td.passage_max_len),
        tokenizer=TokenizerConfig(vocab_size=tokenizer.get_vocab_size()))

    log("[4/7] retrieval: embed held-out passages, ScaNN index, recall@k")
    retrieval, ranked = _retrieval(cfg, data, model, tokenizer, td, fmt, have_minilm, progress)
    timer.stage("retrieval")

    log("[5/7] answering held-out questions: no retrieval / retrieval (full, block) / gold")
    qa, ba = _answers(cfg, data, model, tokenizer, td, ranked[cfg.retrieval.retriever], progress)
    timer.stage("answers")

    log("[6/7] TTFT: full prefill vs cached passages")
    from rag_jax.evaluation.rag import ttft_curve
    docs = [p["text"] for p in data.eval_passages]
    order = [int(j) for j in ranked[cfg.retrieval.retriever][0] if j >= 0]
    order += [j for j in range(len(docs)) if j not in order]
    ttft = ttft_curve(ba, tokenizer, [docs[j] for j in order], data.eval_questions[0]["question"],
                      cfg.eval.ttft_passages, cfg.eval.ttft_repeats, progress)
    timer.stage("ttft")

    log("[7/7] report")
    files = {"metrics": str(out / "metrics.json"), "run_folder": str(out),
             "train_metrics": str(out / "metrics.jsonl"), **_plots(result.history, ttft, out)}
    report = {
        "config": config_lib.to_dict(resolved),
        "data": {"source": data.source, "question_kind": data.question_kind,
                 "train_questions": len(td.questions), "eval_questions": len(data.eval_questions),
                 "train_articles": data.num_articles[0], "eval_articles": data.num_articles[1],
                 "train_passages": len(data.train_passages), "eval_passages": len(data.eval_passages),
                 "train_questions_dropped_too_long": td.dropped},
        "model": {"params": params, "base": str(base_dir) if base_dir else None,
                  **{f: getattr(model_cfg, f) for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                        "vocab_size")}},
        "train": {"steps": cfg.train.steps, "seconds": result.train_seconds, "compile_seconds": result.compile_seconds,
                  "seq_len": td.seq_len, "final": result.history[-1], "history": result.history},
        "retrieval": retrieval,
        "qa": qa,
        "ttft": ttft,
        "devices": f"{mesh.size} x {jax.devices()[0].device_kind}",
        "files": files,
    }
    timer.stage("report")
    report.update(timings=timer.wall, cpu_timings=timer.cpu)
    report["total_seconds"], report["cpu_seconds"] = timer.total()
    from rag_jax.atomic import write_text
    write_text(out / "metrics.json", json.dumps(report, indent=1, default=float))
    log(format_report(report))
    return report


def _retrieval(cfg: DemoConfig, data, model, tokenizer, td, fmt, have_minilm: bool, progress: bool):
    """Stage 4: ``({retriever: metrics}, {retriever: ranked passage indices [q, depth]})``."""
    from rag_jax.evaluation.rag import retrieval_eval
    from rag_jax.model.embedding import GritEmbedder
    from rag_jax.retrieval.embedders import BertEmbedder, embed_texts

    depth = max(max(cfg.retrieval.ks), cfg.task.num_passages + 1)
    docs = [p["text"] for p in data.eval_passages]
    queries = [q["question"] for q in data.eval_questions]
    gold = [q["gold"] for q in data.eval_questions]
    hops = [q["hops"] for q in data.eval_questions]
    embedders = {}
    if have_minilm:
        minilm = BertEmbedder()
        embedders["minilm"] = ("MiniLM-L6 (pretrained)", minilm, minilm.embed)
    grit = GritEmbedder(model, tokenizer, max_length=td.passage_max_len, fmt=fmt)
    embedders["grit"] = ("GRIT (this model)", grit,
                         lambda x: grit.embed(x, instruction=cfg.train.grit_instruction))
    retrieval, ranked = {}, {}
    for key, (name, embed_docs, embed_queries) in embedders.items():
        ranked[key], retrieval[key] = retrieval_eval(
            name, lambda x, e=embed_docs, n=name: embed_texts(e, x, desc=f"{n} passages", progress=progress),
            embed_queries, docs, queries, gold, hops, cfg.retrieval.ks, cfg.retrieval.scann, depth)
    return retrieval, ranked


def _answers(cfg: DemoConfig, data, model, tokenizer, td, ranked, progress: bool):
    """Stage 5: the ``qa`` section of the report, and the ``BlockAttention`` (warm passage caches)."""
    import time

    from tqdm.auto import tqdm

    from rag_jax.evaluation.rag import generate_answers, mean_scores, score_answer, with_gold
    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.inference.kv_store import KVStore

    k = cfg.task.num_passages
    docs = [p["text"] for p in data.eval_passages]
    questions = data.eval_questions[:cfg.eval.max_questions]
    max_new = min(cfg.eval.max_new_tokens, td.answer_tokens + 2)
    ba = BlockAttention(model, store=KVStore(max_bytes=1 << 30))
    prompts = {
        "no_retrieval": [rag_example(tokenizer, q["question"], []).blocks for q in questions],
        "retrieval": [rag_example(tokenizer, q["question"], [docs[j] for j in ranked[i][:k] if j >= 0]).blocks
                      for i, q in enumerate(questions)],
        "oracle": [rag_example(tokenizer, q["question"], [docs[j] for j in with_gold(ranked[i], q["gold"], k)]).blocks
                   for i, q in enumerate(questions)],
    }
    conditions, predictions = {}, {}
    plan = [("no_retrieval", "no_retrieval", "full"), ("retrieval_full", "retrieval", "full"),
            ("retrieval_block", "retrieval", "block"), ("oracle_block", "oracle", "block")]
    for name, which, mode in tqdm(plan, desc="answering", unit="condition", disable=not progress):
        t0 = time.perf_counter()
        preds = generate_answers(ba, tokenizer, prompts[which], mode=mode, max_new_tokens=max_new,
                                 batch_size=cfg.eval.batch_size)
        scores = mean_scores([score_answer(p, q["answer"]) for p, q in zip(preds, questions)])
        conditions[name] = {**scores, "seconds": time.perf_counter() - t0, "mode": mode}
        predictions[name] = preds
    qa = {"num_questions": len(questions), "retriever": cfg.retrieval.retriever, "num_passages": k,
          "max_new_tokens": max_new, "conditions": conditions,
          "kv_store": {"entries": len(ba.store), "bytes": ba.store.nbytes, **ba.store.stats},
          "examples": [{"question": q["question"], "gold": q["answer"],
                        **{c: predictions[c][i] for c in predictions}} for i, q in enumerate(questions[:3])]}
    return qa, ba


def run_cli(args) -> int:
    """``rag-jax demo`` (arguments defined in ``rag_jax.cli``)."""
    cfg = load_demo_config(args.config, args.overrides)
    run(cfg, data_path=args.data, out_dir=args.out, progress=not args.no_progress)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rag_jax.demo ...`` = ``rag-jax demo ...``."""
    import sys

    from rag_jax.cli import main as cli_main
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
