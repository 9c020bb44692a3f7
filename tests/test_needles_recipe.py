"""``rag-jax eval needles`` end to end on a tiny chat model (byte tokens): training rows are the chat prompt with
the answer sentence as the response, one fine-tuning step writes a run folder that loads back, and every
condition of the table is scored from its own replies."""
import json
from pathlib import Path

import numpy as np
from flax import nnx

from rag_jax.data.needles import needle_example
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.load import LoadedModel
from rag_jax.recipes.needles import needles
from rag_jax.tokenizer import byte_tokenizer

CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2, num_kv_heads=1,
                  max_seq_len=1024)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "<|im_start|>assistant\n")


def _tiny(seed):
    return LoadedModel(CFG, Transformer(CFG, rngs=nnx.Rngs(seed)), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE,
                       (10,), {"eos_token": "\n"}, Path("tiny-chat"))


def test_training_rows_hold_the_prompt_and_the_answer():
    loaded = _tiny(0)
    ex = needle_example(np.random.default_rng(), num_dicts=3)
    (row,) = needles.training_rows(loaded, [ex])
    assert bytes(row.response[:-1]).decode() == ex.answer and row.response[-1] == 10
    text = bytes(row.blocks[0]).decode()
    assert ex.prompt in text and text.rstrip("\n").endswith("<|im_start|>assistant")


def test_needles_eval_trains_and_scores_every_condition(tmp_path, monkeypatch):
    from rag_jax.model import load as load_lib
    base = _tiny(int(np.random.default_rng().integers(1 << 30)))
    monkeypatch.setattr(needles, "load_model",
                        lambda src: base if src == "smollm2-135m-instruct" else load_lib.load_model(src))
    out = tmp_path / "needles.json"
    assert needles.main(["--steps", "1", "--train-rows", "8", "--batch-size", "8", "--dicts", "2,3",
                         "--delta-rank", "0", "--warmup", "0", "--lr", "1e-2", "--eval-rows", "2", "--max-new-tokens", "4", "--top-layers", "1",
                         "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    info = json.loads(out.read_text())
    assert info["finetune"]["steps"] == 1 and Path(info["finetune"]["run_dir"], "config.yaml").is_file()
    assert set(info["results"]) == {f"{m}, template {t}" for m in ("base", "tuned") for t in ("on", "off")}
    for cond, r in info["results"].items():
        assert len(r["replies"]) == 2 and 0.0 <= r["value_accuracy"] <= 1.0
    replies = json.loads((tmp_path / "cache" / "replies.json").read_text())
    assert len(replies) == 8                                  # 2 prompts x 2 templates x 2 models, cached
