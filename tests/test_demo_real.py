"""`rag-jax demo --model`: the real-model track's prompt blocks against the chat template, and the track end to
end with a tiny random model in an HF folder (byte tokenizer, ChatML template), checked against a plain greedy
decode of the chat-template prompt."""
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from rag_jax.recipes import rag_demo as demo
from rag_jax.tokenizer import byte_tokenizer, save_tokenizer
from rag_jax.data import chat_blocks, loaders
from rag_jax.recipes.rag_demo import real_model
from rag_jax.inference.chat import chat_prompt, stream_tokens
from rag_jax.text import render_chat
from rag_jax.model import ModelConfig, Transformer

TINY = Path(__file__).resolve().parents[1] / "train" / "configs" / "demo_tiny.yaml"
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _hf_folder(path: Path) -> Path:
    cfg = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      max_seq_len=1024)
    from rag_jax.model.hf import save_hf
    save_hf(Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30)))), path)
    save_tokenizer(byte_tokenizer(), path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return path


class _Loaded:
    def __init__(self):
        self.tokenizer, self.chat_template, self.special_tokens, self.source = byte_tokenizer(), CHATML, {}, Path("tiny")


def test_blocks_are_the_chat_template_prompt():
    """Concatenated block texts == the template rendered around instruction + passages + question."""
    chat = chat_blocks.ChatBlocks(_Loaded())
    passages = ["The hobby of Ada Lee is chess.", " # Bo\nx \n"]
    blocks = chat.blocks("What is the hobby of Ada Lee?", passages)
    message = (chat_blocks.INSTRUCTION + "".join(f"Document: {p.strip()}\n\n" for p in passages)
               + "Question: What is the hobby of Ada Lee?")
    text = render_chat(CHATML, [{"role": "user", "content": message}])
    assert len(blocks) == 4
    assert bytes(t for b in blocks for t in b).decode() == text
    assert bytes(blocks[1]).decode() == "Document: The hobby of Ada Lee is chess.\n\n"
    assert bytes(blocks[-1]).decode().endswith("<|im_end|>\n<|im_start|>assistant\n")
    from rag_jax.evaluation.rag import answer_recall
    assert answer_recall("Ada Lee plays Chess and go.", ["chess", "go", "tennis"]) == 2 / 3


def test_real_track_end_to_end(tmp_path):
    folder = _hf_folder(tmp_path / "hf")
    cfg = demo.load_demo_config(TINY, ["eval.max_questions=3", "eval.max_new_tokens=4", "eval.ttft_passages=[1]",
                                       "retrieval.retriever=bm25"], real_model=True)
    assert cfg.eval.batch_size == demo.config.REAL_MODEL_EVAL["batch_size"]   # real-track default kept
    lines = []
    report = real_model.run_real(cfg, str(folder), out_dir=tmp_path / "out", progress=False, log=lines.append)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == json.loads(json.dumps(report, default=float))
    assert set(report["qa"]["conditions"]) == {"no_retrieval", "retrieval_full", "retrieval_block", "oracle_full",
                                               "oracle_block"}
    assert report["train"] is None and "training: none" in lines[-1] and "answer recall" in lines[-1]
    assert report["qa"]["retriever"] == "bm25" and set(report["retrieval"]) == {"minilm", "bm25"}
    answers = report["qa"]["answers"]                               # per question, the means above
    assert len(answers) == 3 and answers[0]["retrieval_full"]["prediction"] == report["qa"]["examples"][0]["retrieval_full"]
    for c, v in report["qa"]["conditions"].items():
        assert v["subspan_em"] == pytest.approx(np.mean([a[c]["subspan_em"] for a in answers]))
    assert "BM25 (lexical)" in lines[-1] and "MiniLM-L6 (pretrained)" in lines[-1]
    assert report["ttft"][0]["passages"] == 1 and Path(report["files"]["ttft_plot"]).is_file()
    # No-retrieval answers == a plain greedy decode of the chat-template prompt (a different code path).
    from rag_jax.model.load import load_model
    loaded = load_model(folder)
    for ex in report["qa"]["examples"]:
        message = chat_blocks.INSTRUCTION + chat_blocks.QUESTION.format(question=ex["question"])
        ids = list(stream_tokens(loaded.model, chat_prompt(loaded, [{"role": "user", "content": message}]),
                                 max_new_tokens=4))
        assert ex["no_retrieval"] == loaded.tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_real_track_rejects_the_grit_retriever_before_any_work(tmp_path):
    cfg = demo.load_demo_config(TINY, ["retrieval.retriever=grit"], real_model=True)
    with pytest.raises(ValueError, match=r"retrieval.retriever='grit'.*valid: minilm, bm25"):
        real_model.run_real(cfg, "no-such-model", out_dir=tmp_path / "out", progress=False, log=print)
    assert not (tmp_path / "out").exists()


def test_block_nq_split_negatives_and_placement():
    from rag_jax.recipes.block_attention import block_nq
    train, held = loaders.heldout_split(103, 0.2, seed=5)
    assert len(held) == 21 and sorted(train + held) == list(range(103))
    assert loaders.heldout_split(103, 0.2, seed=5) == (train, held) != loaders.heldout_split(103, 0.2, seed=6)
    ranked = np.random.default_rng().permutation(30)
    gold, skip = int(ranked[1]), [int(ranked[0]), int(ranked[4])]
    neg = block_nq.hard_negatives(ranked, gold, 5, skip)
    assert neg == [int(x) for x in ranked if x != gold and x not in skip][:5] and gold not in neg
    assert block_nq.place(neg, gold, 0)[0] == gold and block_nq.place(neg, gold, 5)[-1] == gold
    assert block_nq.place(neg, gold, 2) == [*neg[:2], gold, *neg[2:]]
    with pytest.raises(ValueError, match="search deeper"):
        block_nq.hard_negatives(ranked[:6], gold, 5, skip)
    with pytest.raises(ValueError, match="position=6"):
        block_nq.place(neg, gold, 6)
