"""GRIT data: triples -> [positive, hard negatives] groups per query, instruction-only-on-queries pool masks,
response-only loss masks, separate batch sizes / max lengths, determinism, and clear errors on bad input."""
import re

import numpy as np
import pytest

from rag_jax.data.grit import GritDataConfig, grit_batches, tokenize_generative_record
from rag_jax.tokenizer import train_bpe
from rag_jax.model.embedding import GritFormat

WORDS = "alpha beta gamma delta river mountain city music paper science answer question who what".split()
INSTR = "Retrieve the passage"


@pytest.fixture(scope="module")
def tokenizer():
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, 10)) for _ in range(200)] + ["<|user|>\n<|embed|>\n<|assistant|>\n"] * 10
    return train_bpe(texts, 380, special_tokens=("<pad>", "<s>", "</s>", "<unk>"))


def records(n=6, negs=2):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        out.append({"query": [INSTR, f"q{i} " + " ".join(rng.choice(WORDS, 4))],
                    "pos": [f"pos{i} " + " ".join(rng.choice(WORDS, 6))],
                    "neg": [f"neg{i}x{j} " + " ".join(rng.choice(WORDS, 5)) for j in range(negs)]})
    return out


def gen_records(n=5):
    return [{"text": [f"user{i} what is river", f" answer{i} mountain city ", "and then?", f"more{i}"]}
            for i in range(n)]


def decode(tok, ids, mask):
    return tok.decode([int(t) for t, m in zip(ids, mask) if m], skip_special_tokens=False)


def test_embedding_and_generative_batches(tokenizer):
    cfg = GritDataConfig(embedding_batch_size=4, generative_batch_size=3, group_size=3, query_max_len=48,
                         passage_max_len=20, generative_max_len=96)
    recs = records()
    batch = next(grit_batches(recs, gen_records(), tokenizer, cfg))
    assert batch["query_tokens"].shape == (4, 48) and batch["passage_tokens"].shape == (12, 20)
    assert batch["gen_tokens"].shape == (3, 96)
    assert all(v.dtype == np.int32 for v in batch.values())
    by_query = {r["query"][1]: r for r in recs}
    for i in range(4):
        q_text = decode(tokenizer, batch["query_tokens"][i], batch["query_pool_mask"][i])
        q_prefix = decode(tokenizer, batch["query_tokens"][i],
                          batch["query_attention_mask"][i] * (1 - batch["query_pool_mask"][i]))
        assert q_prefix == GritFormat().embed_prefix(INSTR)  # queries carry the instruction, not pooled
        rec = by_query[q_text]
        group = [decode(tokenizer, batch["passage_tokens"][3 * i + j], batch["passage_pool_mask"][3 * i + j])
                 for j in range(3)]
        assert group[0] == rec["pos"][0]  # layout: [positive, hard negatives...] per query
        assert sorted(group[1:]) == sorted(rec["neg"])
        for j in range(3):
            row = 3 * i + j
            prefix = decode(tokenizer, batch["passage_tokens"][row],
                            batch["passage_attention_mask"][row] * (1 - batch["passage_pool_mask"][row]))
            assert prefix == "<s><|embed|>\n"  # documents: no instruction
    for i in range(3):
        ids, attn, loss = batch["gen_tokens"][i], batch["gen_attention_mask"][i], batch["gen_loss_mask"][i]
        full = decode(tokenizer, ids, attn)
        k = int(re.search(r"\nuser(\d+) ", full).group(1))
        assert full == GritFormat().generation(gen_records()[k]["text"])[0]
        assert decode(tokenizer, ids, loss) == f"answer{k} mountain city</s>more{k}</s>"  # responses + </s> only
        assert attn[len(ids[attn == 1]):].sum() == 0  # right padded


def test_deterministic_and_resumable(tokenizer):
    cfg = GritDataConfig(embedding_batch_size=2, generative_batch_size=2, group_size=2, query_max_len=40,
                         passage_max_len=16, generative_max_len=32, seed=3)
    it = grit_batches(records(), gen_records(), tokenizer, cfg)
    first = [next(it) for _ in range(5)]
    again = next(grit_batches(records(), gen_records(), tokenizer, cfg, start_step=3))
    for k in first[3]:
        np.testing.assert_array_equal(first[3][k], again[k])
    assert any(not np.array_equal(first[0]["query_tokens"], b["query_tokens"]) for b in first[1:])
    only_gen = next(grit_batches(None, gen_records(), tokenizer, cfg))
    assert sorted(only_gen) == ["gen_attention_mask", "gen_loss_mask", "gen_tokens"]


def test_truncation_respects_max_lengths(tokenizer):
    cfg = GritDataConfig(embedding_batch_size=2, generative_batch_size=2, group_size=1, query_max_len=12,
                         passage_max_len=9, generative_max_len=16)
    recs = [{"query": "river " * 30, "pos": ["city " * 30]}, {"query": "a b", "pos": ["c d"]}]
    batch = next(grit_batches(recs, None, tokenizer, cfg))
    assert batch["query_tokens"].shape == (2, 12) and batch["passage_tokens"].shape == (2, 9)
    assert batch["query_attention_mask"].sum(1).max() == 12 and batch["passage_attention_mask"].sum(1).max() == 9


def test_bad_input_errors(tokenizer):
    cfg = GritDataConfig(embedding_batch_size=2, generative_batch_size=2, group_size=2, query_max_len=12,
                         passage_max_len=12, generative_max_len=12)
    good = records(2)
    with pytest.raises(ValueError, match="record 1 has a query but no positive"):
        grit_batches([good[0], dict(good[1], pos=[])], None, tokenizer, cfg)
    with pytest.raises(ValueError, match="record 0 has no hard negative .* group_size=2"):
        grit_batches([dict(good[0], neg=[]), good[1]], None, tokenizer, cfg)
    with pytest.raises(ValueError, match="record 1 'query' has an empty text"):
        grit_batches([good[0], dict(good[1], query=[INSTR, "  "])], None, tokenizer, cfg)
    with pytest.raises(ValueError, match=r"'pos'\[0\] has an empty text"):
        grit_batches([good[0], dict(good[1], pos=[""])], None, tokenizer, cfg)
    long_instr = "alpha beta gamma delta river mountain city music"
    with pytest.raises(ValueError, match="query instruction .* >= query_max_len=12"):
        grit_batches([good[0], dict(good[1], query=[long_instr, "river"])], None, tokenizer, cfg)
    with pytest.raises(ValueError, match="embedding_batch_size=2"):
        grit_batches(good[:1], None, tokenizer, cfg)
    with pytest.raises(ValueError, match="generative record 0 has no response token within generative_max_len=12"):
        tokenize_generative_record({"text": ["alpha beta gamma delta river mountain city music", "x"]}, tokenizer, 12)
    with pytest.raises(ValueError, match="even, non-zero number of turns"):
        tokenize_generative_record({"text": ["only a user turn"]}, tokenizer, 12)
    with pytest.raises(ValueError, match="empty user or assistant"):
        tokenize_generative_record({"text": ["hi", " "]}, tokenizer, 12)
    with pytest.raises(ValueError, match="group_size=0"):
        GritDataConfig(group_size=0)
    with pytest.raises(ValueError, match="needs embedding_records, generative_records or both"):
        grit_batches(None, None, tokenizer, cfg)


def test_grit_configs_load():
    """Every train/configs/grit*.yaml validates into the GRIT run config of ``rag-jax eval grit_eval``."""
    from pathlib import Path

    from rag_jax import config as config_lib
    from rag_jax.recipes.grit import grit_eval

    root = Path(__file__).resolve().parents[1]
    paths = sorted((root / "train" / "configs").glob("grit*.yaml"))
    assert len(paths) >= 3
    for path in paths:
        cfg = config_lib.load_config(grit_eval.GritRunConfig, path)
        assert cfg.grit.temperature == 0.02 and cfg.data.group_size == 2
        assert cfg.data.generative_max_len <= cfg.model.max_seq_len
    with pytest.raises(config_lib.ConfigError, match="loss_gen_type"):
        config_lib.load_config(grit_eval.GritRunConfig, paths[0], ["grit.loss_gen_type=sum"])
    with pytest.raises(config_lib.ConfigError, match="train.objective='lm_causal': .*remove it"):
        config_lib.load_config(grit_eval.GritRunConfig, paths[0], ["train.objective=lm_causal"])
    assert config_lib.load_config(grit_eval.GritRunConfig, paths[0], ["train.remat_policy=full"]).train.remat_policy \
        == "full"


CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_chat_format_generation_spans_and_embedding_prefixes():
    from types import SimpleNamespace

    from rag_jax.data.grit import ChatGritFormat

    fmt = ChatGritFormat(CHATML, (("eos_token", "<|im_end|>"),))
    text, spans = fmt.generation(["who is Bob?", " Bob ", "and Alice?", "Alice"])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nwho is Bob?<|im_end|>\n"
                    "<|im_start|>assistant\nBob<|im_end|>\n<|im_start|>user\nand Alice?<|im_end|>\n"
                    "<|im_start|>assistant\nAlice<|im_end|>\n")
    assert [text[a:b] for a, b in spans] == ["Bob<|im_end|>", "Alice<|im_end|>"]
    # The answer also occurs in the user turn before it: the span is the assistant's copy.
    text, spans = fmt.generation(["Bob or Alice?", "Bob"])
    assert spans[0][0] == text.index("assistant\nBob") + len("assistant\n")
    assert fmt.embed_prefix("Find it") == "<|im_start|>user\nFind it<|im_end|>\n<|im_start|>embed\n"
    assert fmt.embed_prefix("") == "<|im_start|>embed\n"
    with pytest.raises(ValueError, match="even"):
        fmt.generation(["only a question"])
    with pytest.raises(ValueError, match="non-empty"):
        fmt.generation(["q", "  "])
    loaded = SimpleNamespace(tokenizer=object(), chat_template=CHATML, special_tokens={"eos_token": "<|im_end|>"},
                             source="m")
    assert ChatGritFormat.from_loaded(loaded) == fmt
    with pytest.raises(ValueError, match="ChatML"):
        ChatGritFormat.from_loaded(SimpleNamespace(**{**vars(loaded), "chat_template": "{{ messages }}"}))


def test_chat_format_tokenized_masks():
    """Pool masks cover only the text after the ChatML prefix; the loss mask only the answer and <|im_end|>."""
    from rag_jax.data.grit import ChatGritFormat
    from rag_jax.model.embedding import tokenize_for_embedding

    rng = np.random.default_rng(2)
    tok = train_bpe([" ".join(rng.choice(WORDS, 10)) for _ in range(200)] + ["user\nsystem\nembed\nassistant\n"] * 10,
                    380, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    fmt = ChatGritFormat(CHATML, (("eos_token", "<|im_end|>"),))
    ids, pool = tokenize_for_embedding(tok, "river city music", INSTR, max_len=64, fmt=fmt)
    assert decode(tok, ids, pool).strip() == "river city music"
    assert decode(tok, ids, 1 - pool) == f"<|im_start|>user\n{INSTR}<|im_end|>\n<|im_start|>embed\n"
    row = tokenize_generative_record({"text": ["who is river", "mountain city"]}, tok, 96, fmt)
    assert decode(tok, row["gen_tokens"], row["gen_loss_mask"]).strip() == "mountain city<|im_end|>"
