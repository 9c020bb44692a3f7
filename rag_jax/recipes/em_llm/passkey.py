"""Passkey and key-value retrieval far beyond the trained context: EM-LLM vs InfLLM vs sliding window vs full attention.

A small byte-level model (token = UTF-8 byte, vocab 256) is trained at short context (``--train-len`` <= 1K tokens)
on passkey prompts (the standard filler "The grass is green. ..." of the passkey task used by InfLLM / EM-LLM) and
synthetic key-value retrieval prompts (the "Lost in the Middle" JSON format with random UUIDs), then evaluated with
the same weights and five inference methods, all through ``rag_jax.memory.EMLLM``:

- ``em_llm``: surprise segmentation + similarity retrieval (``--em-config``, default train/configs/em_llm_passkey.yaml,
  InfLLM positions: memory keys unrotated, query at distance ``n_local - 1``);
- ``em_llm_contiguous``: the same with retrieved memory re-encoded at contiguous positions before the window;
- ``inf_llm``: the same code with fixed ``--infllm-block``-token blocks (``segmentation: uniform``);
- ``sliding``: the local window only (``memory: false``);
- ``full``: full causal attention (a window covering the whole input; exact, verified by the tests), run only up to
  ``--full-max`` tokens (its cost grows quadratically).

Passkey accuracy (5-digit key, greedy decoding, exact match) is reported per method and length, with the key at
evenly spread depths. With ``--kv-samples N`` it also scores the real file
``../shared/data/lost_in_the_middle/kv-retrieval-75_keys.jsonl.gz`` (75 UUID pairs, ~6.3K tokens; correct when the
gold value appears in the output).

``--model PATH`` is loaded when it exists (a run folder or an HF folder,
``rag_jax.evaluation.models.load_for_eval``); otherwise a model is trained with the one trainer
(``rag_jax.train.trainer.run``) and PATH becomes its run folder (tokenizer: ``byte_tokenizer``). Examples::

    rag-jax eval passkey --model runs/passkey_model                     # train if missing, small eval
    # the reported model (the defaults: 3 layers, hidden 128, 2,500 steps x 16 rows of 256 tokens; ~20 min on
    # 2 CPU cores). 2 layers plateau at ~35% exact even at 256 tokens: single-token induction cannot copy keys
    # with a repeated digit (70% of 5-digit keys); the third layer gives the copy two tokens of context.
    rag-jax eval passkey --model runs/passkey_model --lengths 256 --methods full em_llm
    rag-jax eval passkey --model runs/passkey_model --lengths 4096 16384 65536 262144 1048576 --samples 5
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from rag_jax import sharding
from rag_jax.data.loaders import load_kv_retrieval, shared_file
from rag_jax.data.pipeline import DataConfig
from rag_jax.args import ScriptParser, input_file, integer, model_source, output_file, real
from rag_jax.evaluation.models import load_for_eval
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer
from rag_jax.memory import EMLLM, EMLLMConfig
from rag_jax.model import ModelConfig, Transformer
from rag_jax.tokenizer import byte_tokenizer
from rag_jax.train import optim, trainer
from rag_jax.train.checkpoint import CheckpointConfig
from rag_jax.train.objectives.lm import LMLoss

KV_FILE = shared_file("lost_in_the_middle", "kv-retrieval-75_keys.jsonl.gz")
EM_CONFIG = Path(__file__).resolve().parents[3] / "train" / "configs" / "em_llm_passkey.yaml"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
# The standard needle and question with a colon before the key (no colon occurs in the filler), so a small
# byte-level model trained for minutes on CPU learns the copy: the token before the answer is distinctive.
NEEDLE = "The pass key is:{key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is:"
KV_INTRO = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
ANSWER_WEIGHT = 10.0
METHODS = ("em_llm", "em_llm_contiguous", "inf_llm", "sliding", "full")
# Variants for the real-model evaluation (rag_jax.recipes.em_llm.long_context); method_config knows them all.
EM_VARIANTS = ("em_llm_refine", "em_llm_contiguity")
MIN_PASSKEY_LEN = len(NEEDLE.format(key="12345")) + len(QUESTION) + 16


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids (int32)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode(ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def passkey_example(rng: np.random.Generator, length: int, depth: float) -> tuple[np.ndarray, str]:
    """A prompt of ``length`` tokens with a 5-digit key at relative ``depth`` of the filler; returns (ids, key)."""
    key = f"{rng.integers(10000, 100000)}"
    needle = NEEDLE.format(key=key)
    room = length - len(needle) - len(QUESTION)
    if length < MIN_PASSKEY_LEN:
        raise ValueError(f"length={length} tokens is too short for a passkey prompt (>= {MIN_PASSKEY_LEN})")
    filler = (FILLER * (room // len(FILLER) + 1))[:room]
    cut = int(depth * room)
    cut = filler.rfind(". ", 0, cut) + 2 if filler.rfind(". ", 0, cut) >= 0 else 0
    text = filler[:cut] + needle + filler[cut:] + QUESTION
    return encode(text), key


def kv_prompt(records, key: str) -> str:
    """The "Lost in the Middle" key-value retrieval prompt (answer: the value's UUID)."""
    body = ",\n ".join(f'"{k}": "{v}"' for k, v in records)
    return KV_INTRO + "{" + body + "}\n\nKey: \"" + key + "\"\nCorresponding value:"


def synthetic_kv_example(rng: np.random.Generator, max_len: int) -> tuple[str, str]:
    def uuid():
        h = "".join(rng.choice(list("0123456789abcdef"), 32))
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    pairs = max(2, int(rng.integers(2, max(3, (max_len - 200) // 80))))
    records = [(uuid(), uuid()) for _ in range(pairs)]
    key, value = records[int(rng.integers(pairs))]
    return kv_prompt(records, key), f' "{value}"'


def repeat_example(rng: np.random.Generator, length: int) -> str:
    """Random digit strings, each repeated after some filler: dense copy targets that make induction heads form
    quickly (Olsson et al. 2022), the mechanism passkey and KV retrieval need."""
    sentences = FILLER.split(". ")
    text = ""
    while len(text) < length:
        digits = "".join(rng.choice(list("0123456789"), int(rng.integers(5, 16))))
        gap = ". ".join(rng.choice(sentences, int(rng.integers(1, 4))))
        text += f"{digits}. {gap}. {digits}. "
    return text[:length]


def training_batch(rng: np.random.Generator, batch: int, seq_len: int) -> dict[str, np.ndarray]:
    """Rows (each padded): passkey prompts with their answers (6 of 8), repeated digit strings (1 of 8),
    synthetic KV prompts (1 of 8). KV rows are mostly random hex (irreducible loss); more of them slowed the
    copy circuit's formation past 2,500 steps, while with this mix it forms in ~500.

    ``loss_mask`` weighs every token 1 and the answered key ``ANSWER_WEIGHT``: the model first copied the key's
    later digits (previous-digit induction) but missed the first one, the only prediction that needs the jump
    from the question's ``is:`` to the needle's; its few targets per row were swamped by filler."""
    tokens = np.zeros((batch, seq_len), np.int32)
    segment_ids = np.zeros((batch, seq_len), np.int32)
    loss_mask = np.ones((batch, seq_len), np.float32)
    for row in range(batch):
        if row % 8 < 6:
            prompt, key = passkey_example(rng, int(rng.integers(MIN_PASSKEY_LEN, seq_len - 8)), rng.random())
            ids = np.concatenate([prompt, encode(key + ".")])
            loss_mask[row, len(prompt):len(prompt) + len(key)] = ANSWER_WEIGHT
        elif row % 8 == 6:
            ids = encode(repeat_example(rng, seq_len))
        else:
            text, answer = synthetic_kv_example(rng, seq_len)
            ids = encode(text + answer)[:seq_len]
        tokens[row, :len(ids)] = ids
        segment_ids[row, :len(ids)] = 1
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids, "loss_mask": loss_mask}


def train_model(cfg: ModelConfig, steps: int, batch: int, seq_len: int, lr: float, seed: int,
                init: Transformer | None = None, run_dir: str | Path | None = None,
                progress: bool = True) -> Transformer:
    """Train with the one trainer (causal LM loss, :func:`training_batch` rows) on one device, from ``init``'s
    weights if given (a fresh optimizer); ``run_dir``: write the run folder there (``load_model`` reads it)."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    run_cfg = trainer.RunConfig(
        model=cfg, mesh=sharding.MeshConfig(data=1, fsdp=1, tensor=1), data=DataConfig(seq_len=seq_len),
        optimizer=optim.OptimizerConfig(learning_rate=lr, warmup_steps=min(100, steps // 10), weight_decay=0.01),
        train=trainer.TrainConfig(steps=steps, global_batch_size=batch, seed=seed, log_every=min(50, steps),
                                  objective="lm_causal", run_dir=str(run_dir) if run_dir else None),
        checkpoint=CheckpointConfig(save_every=steps, keep=1, async_save=False),
        logging=trainer.LoggingConfig(progress_bar=progress))
    rng = np.random.default_rng(seed)
    task = trainer.Task(LMLoss(mode="causal"), lambda step: training_batch(rng, batch, seq_len), name="passkey reader",
                        tokenizer=byte_tokenizer())
    result = trainer.run(run_cfg, task, init_params=None if init is None else nnx.state(init, nnx.Param), mesh=mesh)
    return nnx.merge(result.graphdef, result.state.params)


def load_model(path: str | Path) -> Transformer:
    """The model of a run folder (e.g. :func:`train_model`'s ``run_dir``) or an HF folder."""
    return load_for_eval(path).model


def method_config(method: str, base: EMLLMConfig, length: int, infllm_block: int) -> EMLLMConfig:
    if method == "em_llm":
        return base
    if method == "em_llm_contiguous":   # the same, memory re-encoded at contiguous positions
        return base.replace(positions="contiguous")
    if method == "em_llm_refine":       # boundaries refined by modularity (the paper's SM rows)
        return base.replace(refinement="modularity")
    if method == "em_llm_contiguity":   # plus the contiguity buffer of temporal neighbours (SM+C's C)
        return base.replace(contiguity=True)
    if method == "inf_llm":
        return base.replace(segmentation="uniform", refinement=None, min_block_size=infllm_block,
                            max_block_size=infllm_block, n_mem=max(base.n_mem, infllm_block))
    if method == "sliding":
        return base.replace(memory=False)
    if method == "full":   # a window covering the input: exact full attention
        return base.replace(n_local=length + 1, memory=False)
    raise ValueError(f"method={method!r}; valid: {METHODS + EM_VARIANTS}")


def run_prompt(model, cfg: EMLLMConfig, cache: dict, prompt: np.ndarray, max_new_tokens: int) -> tuple[str, float]:
    em = cache.get(cfg)
    if em is None:
        em = cache[cfg] = EMLLM(model, cfg)
    em.reset()
    timer = StageTimer()
    out = em.generate(prompt, max_new_tokens)
    timer.stage("generate")
    return decode(out), timer.wall["generate"]


def _model_or_new_run(text: str) -> Path:
    """``--model``: an existing model (checked now), or a path where a newly trained run folder can go."""
    return Path(model_source(text)) if Path(text).exists() else output_file(text)


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval passkey", description=__doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--model", "--checkpoint", dest="model", type=_model_or_new_run, default="runs/passkey_model",
                   help="run folder or HF folder: loaded if it exists, else a model is trained and its run folder "
                        "written there")
    p.add_argument("--train-steps", type=integer(1), default=2500)
    p.add_argument("--train-len", type=integer(MIN_PASSKEY_LEN + 64, 1024), default=256,
                   help="training context in tokens (<= 1024: short-context training)")
    p.add_argument("--batch", type=integer(1), default=16)
    p.add_argument("--layers", type=integer(1), default=3, help="layers of a newly trained model")
    p.add_argument("--hidden", type=integer(4), default=128, help="hidden size of a newly trained model (4 heads)")
    p.add_argument("--lr", type=real(0, lo_open=True), default=2e-3)
    p.add_argument("--init-from", type=model_source, default=None,
                   help="start training from this model (run or HF folder; fine-tune further), not random weights")
    p.add_argument("--lengths", type=integer(1), nargs="+", default=[4096, 16384])
    p.add_argument("--samples", type=integer(1), default=4, help="passkey prompts per length (depths evenly spread)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--em-config", type=input_file, default=str(EM_CONFIG))
    p.add_argument("--infllm-block", type=integer(1), default=128, help="InfLLM fixed block size in tokens")
    p.add_argument("--full-max", type=integer(1), default=16384, help="longest input run with full attention")
    p.add_argument("--kv-samples", type=integer(0), default=0, help="examples of the real KV-retrieval file to score")
    p.add_argument("--seed", type=integer(0), default=0)
    args = p.parse_args(argv)
    base = EMLLMConfig.from_yaml(args.em_config)  # a bad config fails before training

    if args.model.exists():
        model = load_model(args.model)
        print(f"loaded {args.model}")
    else:
        cfg = ModelConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_layers=args.layers, num_heads=4, num_kv_heads=2, max_seq_len=args.train_len,
                          rope_theta=10000.0)
        init = load_model(args.init_from) if args.init_from else None
        if init is not None:
            cfg = init.config.replace(max_seq_len=max(init.config.max_seq_len, args.train_len))
        model = train_model(cfg, args.train_steps, args.batch, args.train_len, args.lr, args.seed, init,
                            run_dir=args.model)
        print(f"saved {args.model}")
    rng = np.random.default_rng(args.seed + 1)
    cache: dict = {}
    results: dict[tuple[str, int], list[bool]] = {}
    digits: dict[tuple[str, int], list[float]] = {}
    speed: dict[str, list[float]] = {m: [] for m in args.methods}
    for length in args.lengths:
        examples = [passkey_example(rng, length, (i + 0.5) / args.samples) for i in range(args.samples)]
        for method in args.methods:
            if method == "full" and length > args.full_max:
                continue
            cfg = method_config(method, base, length, args.infllm_block)
            for prompt, key in examples:
                out, seconds = run_prompt(model, cfg, cache, prompt, 5)
                results.setdefault((method, length), []).append(out.startswith(key))
                digits.setdefault((method, length), []).append(np.mean([a == b for a, b in zip(out, key)]))
                speed[method].append(len(prompt) / seconds)
            acc, dig = np.mean(results[(method, length)]), np.mean(digits[(method, length)])
            print(f"  {method:8s} {length:>8d} tokens: accuracy {acc:.2f}, digits {dig:.2f} "
                  f"({np.median(speed[method]):,.0f} tok/s)", flush=True)

    print(f"\nPasskey accuracy: exact match of the 5-digit key / share of key digits right (chance 0.10); "
          f"{args.samples} prompts per length; model trained at {model.config.max_seq_len} tokens")
    rows = [[method, *(f"{np.mean(results[(method, n)]):.2f} / {np.mean(digits[(method, n)]):.2f}"
                       if (method, n) in results else "-" for n in args.lengths),
             float(np.median(speed[method])) if speed[method] else "-"] for method in args.methods]
    print(table(["method", *(f"{n:,}" for n in args.lengths), "median tok/s"], rows, floatfmt=",.0f"))

    if args.kv_samples:
        if not KV_FILE.exists():
            print(f"\nKV retrieval skipped: {KV_FILE} is absent")
            return 0
        examples = load_kv_retrieval(KV_FILE, limit=args.kv_samples)
        print(f"\nKey-value retrieval, {KV_FILE.name}, {len(examples)} examples (gold value in the output)")
        rows = []
        for method in args.methods:
            hits, lengths = [], []
            for ex in examples:
                prompt = encode(kv_prompt(ex.kv_records, ex.key))
                if method == "full" and len(prompt) > args.full_max:
                    continue
                out, _ = run_prompt(model, method_config(method, base, len(prompt), args.infllm_block), cache,
                                    prompt, 40)
                hits.append(ex.value in out)
                lengths.append(len(prompt))
            if hits:
                rows.append([method, float(np.mean(hits)), float(np.median(lengths))])
        print(table(["method", "accuracy", "prompt tokens"], rows, floatfmt=("", ".2f", ",.0f")))
    return 0
