"""Fuzzing the file loaders with hypothesis (issue 27): GGUF (header, metadata counts and types, tensor dims and
offsets), safetensors headers, HF ``config.json``, run-folder ``config.yaml`` and ``tokenizer.json``.

Each loader gets a small valid seed file; hypothesis mutates it (for GGUF: the header, every metadata length / type /
count and tensor-info field found by walking the seed, plus well-formed files with fuzzed metadata values and tensor
shapes; for the JSON/YAML files: structured edits of their keys and values; for all: raw byte edits, inserts,
deletes, truncation) and the loader must either load it or raise ``ValueError`` / ``FileNotFoundError`` with one line
naming the file, within a time and peak-RSS bound; any other exception fails. The regressions at the end are inputs
the fuzzer found, each failing on the code before issue 27.

The CI budget is small (``RAG_JAX_FUZZ_EXAMPLES``, default 25 per fuzzer). The long run for the issue note:

    RAG_JAX_FUZZ_EXAMPLES=1500 RAG_JAX_FUZZ_REPORT=fuzz.json python -m pytest -q tests/test_fuzz_loaders.py

writes, per loader, the inputs tried, how many loaded, the distinct error messages (numbers masked), crashes, the
slowest input and the peak RSS (and the baseline after loading the seeds). Measured with 2,000 inputs per fuzzer
(2026-12-02, 2 shared CPU cores, 142 s user CPU): 12,000 inputs, 0 crashes, 0 over the time bound (slowest 2.1 s);
loaded / distinct errors: GGUF bytes 85 / 280, GGUF values 108 / 292, safetensors 140 / 89, config.json 584 / 190,
config.yaml 204 / 362, tokenizer.json 221 / 60; peak RSS 416 MB vs 353 MB after loading the seeds.
"""
import collections
import json
import os
import re
import resource
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from rag_jax.tokenizer import byte_tokenizer, load_tokenizer  # noqa: E402
from rag_jax.model import ModelConfig, Transformer  # noqa: E402
from rag_jax.model.hf import load_hf, save_hf  # noqa: E402
from rag_jax.model.load import load_model  # noqa: E402
from rag_jax.model.run_folder import read_run_config  # noqa: E402

EXAMPLES = int(os.environ.get("RAG_JAX_FUZZ_EXAMPLES", "25"))
TIME_LIMIT_S = 10.0          # per input; the seeds load in well under a second
RSS_GROWTH_LIMIT_MB = 512    # peak RSS over the process's RSS after the seeds loaded; every input is < 200 KB
BASELINE_RSS_MB = [0.0]
STATS: dict[str, dict] = collections.defaultdict(lambda: {"inputs": 0, "loaded": 0, "errors": collections.Counter()})
VOCAB, HIDDEN, INTER, HEADS = 264, 8, 16, 2
INTERESTING = [0, 1, 2, 3, 7, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1]


# ------------------------------------------------------------------------------------------------ seeds
def _gguf_parts():
    """The seed GGUF's metadata (key -> (value, GGUF value type)) and tensors (name -> float32 array)."""
    from tokenizers import pre_tokenizers

    T = gguf.GGUFValueType
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<pad{i}>" for i in range(VOCAB - len(tokens))]
    meta = {"general.architecture": ("llama", T.STRING), "llama.block_count": (1, T.UINT32),
            "llama.context_length": (64, T.UINT32), "llama.embedding_length": (HIDDEN, T.UINT32),
            "llama.feed_forward_length": (INTER, T.UINT32), "llama.attention.head_count": (HEADS, T.UINT32),
            "llama.attention.head_count_kv": (1, T.UINT32), "llama.rope.freq_base": (10000.0, T.FLOAT32),
            "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32),
            "llama.rope.dimension_count": (HIDDEN // HEADS, T.UINT32),
            "tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.pre": ("smollm", T.STRING),
            "tokenizer.ggml.tokens": (tokens, T.ARRAY),
            "tokenizer.ggml.token_type": ([3 if t.startswith("<|") else 1 for t in tokens], T.ARRAY),
            "tokenizer.ggml.merges": (["Ġ t", "h e", "Ġt he"], T.ARRAY),
            "tokenizer.ggml.bos_token_id": (tokens.index("<|im_start|>"), T.UINT32),
            "tokenizer.ggml.eos_token_id": (tokens.index("<|im_end|>"), T.UINT32),
            "tokenizer.ggml.add_bos_token": (True, T.BOOL),
            "tokenizer.chat_template": ("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
                                        T.STRING)}
    d = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (d, HIDDEN),
              "blk.0.attn_v.weight": (d, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (INTER, HIDDEN), "blk.0.ffn_up.weight": (INTER, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, INTER)}
    rng = np.random.default_rng(0)
    return meta, {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _write_gguf(path: Path, meta: dict, tensors: dict) -> bytes:
    w = gguf.GGUFWriter(str(path), None)
    for key, (value, vtype) in meta.items():
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _gguf_seed(path: Path) -> bytes:
    return _write_gguf(path, *_gguf_parts())


def _hf_seed(folder: Path) -> None:
    cfg = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      max_seq_len=64)
    from flax import nnx
    save_hf(Transformer(cfg, rngs=nnx.Rngs(0)), folder)


RUN_YAML = """model:
  vocab_size: 64
  hidden_size: 16
  intermediate_size: 32
  num_layers: 1
  num_heads: 2
  num_kv_heads: 1
  max_seq_len: 64
optimizer:
  learning_rate: 0.001
  warmup_steps: 2
train:
  steps: 10
  seed: 3
  precision: fp32
"""


# ------------------------------------------------------------------------------------------------ mutations
@st.composite
def byte_edits(draw, seed: bytes, fields: list[tuple[int, int]] = ()):
    """Raw and structured edits of ``seed``: overwrite integer fields (``(offset, width)``) with interesting
    values, overwrite random bytes, insert/delete a run, or truncate."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["field", "bytes", "int", "delete", "insert", "truncate"] if fields else
                                    ["bytes", "int", "delete", "insert", "truncate"]))
        n = len(data)
        if n == 0:
            break
        if kind == "field":
            offset, width = draw(st.sampled_from(fields))
            value = draw(st.sampled_from(INTERESTING) | st.integers(0, 2**64 - 1)) % (1 << (8 * width))
            data[offset:offset + width] = value.to_bytes(width, "little")
        elif kind == "bytes":
            at = draw(st.integers(0, n - 1))
            data[at:at + 8] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "int":
            at = draw(st.integers(0, max(n - 8, 0)))
            data[at:at + 8] = struct.pack("<Q", draw(st.sampled_from(INTERESTING)))
        elif kind == "delete":
            at = draw(st.integers(0, n - 1))
            del data[at:at + draw(st.integers(1, 64))]
        elif kind == "insert":
            at = draw(st.integers(0, n))
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
        else:
            data = data[:draw(st.integers(0, n - 1))]
    return bytes(data)


def _walk_gguf(path: Path) -> list[tuple[int, int]]:
    """``(offset, width)`` of the integer fields a GGUF file is parsed by: version, tensor and metadata counts,
    every metadata key length, value type, string length and array item type / count, and every tensor's name
    length, dimension count, dims, type and data offset (found by walking the seed with ``GGUFReader``, whose
    parts are views of the file's bytes)."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    out = []
    for part in [p for f in reader.fields.values() for p in f.parts] + [p for t in reader.tensors
                                                                       for p in t.field.parts]:
        if part.dtype.kind in "ui" and part.dtype.itemsize in (4, 8) and part.size <= 4:
            at = int(part.ctypes.data - base)
            out += [(at + i * part.dtype.itemsize, part.dtype.itemsize) for i in range(part.size)]
    return sorted(set(out))


_GGUF_FIELDS: list[tuple[int, int]] = []


@st.composite
def json_edits(draw, seed: dict):
    """A structured edit of a JSON object: a key set to a random JSON value, deleted, or a nested value changed."""
    data = json.loads(json.dumps(seed))
    values = st.recursive(st.none() | st.booleans() | st.sampled_from(INTERESTING) | st.integers(-2**70, 2**70)
                          | st.floats() | st.text(max_size=12),
                          lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                          max_leaves=6)
    for _ in range(draw(st.integers(1, 3))):
        node = data
        for _ in range(draw(st.integers(0, 2))):
            children = [k for k, v in node.items() if isinstance(v, dict)] if isinstance(node, dict) else []
            if not children:
                break
            node = node[draw(st.sampled_from(sorted(children)))]
        if not isinstance(node, dict) or not node:
            break
        key = draw(st.sampled_from(sorted(node)) | st.text(max_size=8))
        if draw(st.booleans()) and key in node:
            del node[key]
        else:
            node[key] = draw(values)
    return json.dumps(data, allow_nan=True)


# ------------------------------------------------------------------------------------------------ the check
def _check(loader: str, file: Path, call) -> None:
    stats = STATS[loader]
    stats["inputs"] += 1
    t0 = time.perf_counter()
    try:
        call()
        stats["loaded"] += 1
    except (ValueError, FileNotFoundError) as e:
        message = str(e)
        assert message and "\n" not in message, f"{loader}: multi-line or empty error: {message!r}"
        assert file.name in message, f"{loader}: the error does not name the file {file.name}: {message}"
        stats["errors"][re.sub(r"\d+", "N", message.replace(str(file), "FILE"))[:160]] += 1
    except BaseException:
        stats["unexpected"] = stats.get("unexpected", 0) + 1     # a crash: any other exception type
        raise
    elapsed = time.perf_counter() - t0
    if elapsed >= TIME_LIMIT_S:
        stats["slow"] = stats.get("slow", 0) + 1
    assert elapsed < TIME_LIMIT_S, f"{loader}: one input took {elapsed:.1f} s"
    stats["max_seconds"] = max(stats.get("max_seconds", 0.0), elapsed)
    stats["peak_rss_mb"] = _rss_mb()
    assert stats["peak_rss_mb"] - BASELINE_RSS_MB[0] < RSS_GROWTH_LIMIT_MB, (
        f"{loader}: peak RSS grew {stats['peak_rss_mb'] - BASELINE_RSS_MB[0]:.0f} MB while fuzzing (files < 200 KB)")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
                suppress_health_check=list(HealthCheck))


SEEDS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _seeds(tmp_path_factory):
    """The seed files (module-level ``SEEDS``, so hypothesis does not print them with a failing example)."""
    root = tmp_path_factory.mktemp("seeds")
    SEEDS["gguf"] = _gguf_seed(root / "seed.gguf")
    _GGUF_FIELDS[:] = _walk_gguf(root / "seed.gguf")
    _hf_seed(root / "hf")
    SEEDS["hf"] = root / "hf"
    SEEDS["tokenizer"] = json.loads(byte_tokenizer().to_str())


def test_seeds_load(tmp_path):
    """The seeds load (so the fuzzers start from valid files); the RSS after loading each kind is the baseline."""
    seeds = SEEDS
    path = tmp_path / "m.gguf"
    path.write_bytes(seeds["gguf"])
    loaded = load_model(path)
    assert loaded.tokenizer.encode("the").ids and loaded.config.num_layers == 1
    load_hf(seeds["hf"])
    _run_folder(tmp_path).joinpath("config.yaml").write_text(RUN_YAML)
    assert read_run_config(tmp_path)["train"]["steps"] == 10
    (tmp_path / "tokenizer.json").write_text(json.dumps(seeds["tokenizer"]))
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("ab").ids == [97, 98]
    BASELINE_RSS_MB[0] = _rss_mb()


@FUZZ
@given(data=st.data())
def test_fuzz_gguf(tmp_path_factory, data):
    seeds = SEEDS
    blob = data.draw(byte_edits(seeds["gguf"], _GGUF_FIELDS))
    path = tmp_path_factory.mktemp("g") / "fuzz.gguf"
    path.write_bytes(blob)
    _check("gguf", path, lambda: load_model(path))


def _gguf_value(draw):
    """A random typed metadata value: (value, GGUF type); values of the wrong kind or range on purpose."""
    T = gguf.GGUFValueType
    kind = draw(st.sampled_from(["uint32", "int32", "uint64", "int64", "float32", "bool", "string", "array_str",
                                 "array_int"]))
    if kind in ("uint32", "uint64"):
        bits = 32 if kind == "uint32" else 64
        return draw(st.sampled_from(INTERESTING) | st.integers(0, 300)) % (1 << bits), getattr(T, kind.upper())
    if kind in ("int32", "int64"):
        bits = 31 if kind == "int32" else 63
        return draw(st.integers(-(1 << bits), (1 << bits) - 1)), getattr(T, kind.upper())
    if kind == "float32":
        return draw(st.floats(width=32)), T.FLOAT32
    if kind == "bool":
        return draw(st.booleans()), T.BOOL
    if kind == "string":
        return draw(st.text(max_size=12) | st.sampled_from(["llama", "qwen2", "gpt2", "linear", "yarn", "smollm"])), \
            T.STRING
    if kind == "array_str":
        return draw(st.lists(st.text(max_size=6), max_size=6)), T.ARRAY
    return draw(st.lists(st.integers(-5, 300), min_size=1, max_size=6)), T.ARRAY


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_metadata_and_tensors(tmp_path_factory, data):
    """Well-formed GGUF files whose metadata values (types, ranges, missing keys) and tensors (missing, dims,
    shapes) are fuzzed: the importer's own checks, past the reader."""
    meta, tensors = _gguf_parts()
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(meta)))
        if data.draw(st.integers(0, 3)) == 0:
            del meta[key]
        else:
            meta[key] = _gguf_value(data.draw)
    for _ in range(data.draw(st.integers(0, 2))):
        name = data.draw(st.sampled_from(sorted(tensors)))
        choice = data.draw(st.integers(0, 2))
        if choice == 0:
            del tensors[name]
        else:
            shape = tuple(data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
            tensors[name] = np.ones(shape, np.float32)
    path = tmp_path_factory.mktemp("gm") / "fuzz.gguf"
    _write_gguf(path, meta, tensors)
    _check("gguf metadata", path, lambda: load_model(path))


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header(tmp_path_factory, data):
    seeds = SEEDS
    folder = tmp_path_factory.mktemp("st")
    for f in seeds["hf"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    st_file = folder / "model.safetensors"
    raw = st_file.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + header_len])
    if data.draw(st.booleans()):
        blob = data.draw(byte_edits(raw[:8 + header_len], [(0, 8)])) + raw[8 + header_len:]
    else:
        text = data.draw(json_edits(header)).encode()
        blob = struct.pack("<Q", len(text)) + text + raw[8 + header_len:]
    st_file.write_bytes(blob)
    _check("safetensors", st_file, lambda: load_hf(folder))


@FUZZ
@given(data=st.data())
def test_fuzz_config_json(tmp_path_factory, data):
    seeds = SEEDS
    folder = tmp_path_factory.mktemp("cj")
    for f in seeds["hf"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    seed = json.loads((folder / "config.json").read_text())
    if data.draw(st.booleans()):
        text = data.draw(json_edits(seed)).encode()
    else:
        text = data.draw(byte_edits((folder / "config.json").read_bytes()))
    (folder / "config.json").write_bytes(text)
    _check("config.json", folder / "config.json", lambda: load_hf(folder))


def _run_folder(folder):
    """``folder`` with the files a run folder must have besides ``config.yaml`` (read_run_config checks them)."""
    (folder / "checkpoints").mkdir(exist_ok=True)
    (folder / "tokenizer.json").touch()
    return folder


@FUZZ
@given(data=st.data())
def test_fuzz_run_config_yaml(tmp_path_factory, data):
    import yaml
    folder = _run_folder(tmp_path_factory.mktemp("y"))
    path = folder / "config.yaml"
    if data.draw(st.booleans()):
        text = yaml.safe_dump(json.loads(data.draw(json_edits(yaml.safe_load(RUN_YAML))))).encode()
    else:
        text = data.draw(byte_edits(RUN_YAML.encode()))
    path.write_bytes(text)
    _check("config.yaml", path, lambda: read_run_config(folder))


@FUZZ
@given(data=st.data())
def test_fuzz_tokenizer_json(tmp_path_factory, data):
    seeds = SEEDS
    path = tmp_path_factory.mktemp("t") / "tokenizer.json"
    if data.draw(st.booleans()):
        text = data.draw(json_edits(seeds["tokenizer"])).encode()
    else:
        text = data.draw(byte_edits(json.dumps(seeds["tokenizer"]).encode()))
    path.write_bytes(text)
    _check("tokenizer.json", path, lambda: load_tokenizer(path))


def test_fuzz_report():
    """Writes the per-loader numbers (``RAG_JAX_FUZZ_REPORT``) and checks every loader was exercised."""
    report = {k: {"inputs": v["inputs"], "loaded": v["loaded"], "distinct_errors": len(v["errors"]),
                  "crashes": v.get("unexpected", 0), "slow": v.get("slow", 0), "max_seconds": round(v.get("max_seconds", 0), 3),
                  "peak_rss_mb": round(v.get("peak_rss_mb", 0), 1), "baseline_rss_mb": round(BASELINE_RSS_MB[0], 1),
                  "errors": dict(v["errors"].most_common())} for k, v in STATS.items()}
    if os.environ.get("RAG_JAX_FUZZ_REPORT"):
        Path(os.environ["RAG_JAX_FUZZ_REPORT"]).write_text(json.dumps(report, indent=1))
    if len(STATS) == 6:                       # the whole module ran (not one test selected alone)
        assert all(v["inputs"] >= EXAMPLES and v["crashes"] == v["slow"] == 0 for v in report.values()), report


# ------------------------------------------------------------------------------------------------ regressions
def _gguf_with(tmp_path, **overrides) -> Path:
    meta, tensors = _gguf_parts()
    meta.update(overrides)
    path = tmp_path / f"bad{len(list(tmp_path.glob('*.gguf')))}.gguf"
    _write_gguf(path, meta, tensors)
    return path


def test_gguf_regressions_name_file_and_field(tmp_path):
    T = gguf.GGUFValueType
    cases = [(_gguf_with(tmp_path, **{"llama.attention.head_count": ("two", T.STRING)}),
              r"llama\.attention\.head_count='two' must be an int"),
             (_gguf_with(tmp_path, **{"tokenizer.ggml.bos_token_id": (5000, T.UINT32)}),
              r"tokenizer\.ggml\.bos_token_id=5000 is not a token id"),
             (_gguf_with(tmp_path, **{"llama.block_count": (2**31 - 1, T.UINT32)}),
              r"block_count=2147483647 exceeds the file's 11 tensors")]
    for path, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            load_model(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    blob = bytearray(_gguf_with(tmp_path).read_bytes())
    blob[8:16] = struct.pack("<Q", 2**63)                       # tensor_count
    (tmp_path / "count.gguf").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"count\.gguf: GGUF header counts \(tensor_count=9223372036854775808"):
        load_model(tmp_path / "count.gguf")


def test_hf_folder_regressions_name_file_and_field(tmp_path):
    import shutil
    folder = tmp_path / "hf"
    shutil.copytree(SEEDS["hf"], folder)
    good = json.loads((folder / "config.json").read_text())
    for text, match in [("[1, 2]", r"config\.json: must hold a JSON object; got list"),
                        (json.dumps({k: v for k, v in good.items() if k != "vocab_size"}),
                         r"config\.json: config field vocab_size is missing"),
                        (json.dumps({**good, "num_hidden_layers": "1"}), r"config field num_hidden_layers='1'"),
                        (json.dumps({**good, "rope_parameters": {"rope_theta": None}}),
                         r"rope_parameters\.rope_theta=None")]:
        (folder / "config.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            load_hf(folder)
    (folder / "config.json").write_text(json.dumps(good))
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file \(.*header too large"):
        load_hf(folder)


def test_run_config_regressions_name_file_and_field(tmp_path):
    path = _run_folder(tmp_path) / "config.yaml"
    for text, match in [("model: [", r"config\.yaml is not valid YAML"),
                        (RUN_YAML.replace("precision: fp32", "precision: fp99"),
                         r"config\.yaml: train\.precision='fp99' is not valid"),
                        (RUN_YAML.replace("hidden_size: 16", "hidden_size: -3"), r"config\.yaml: invalid model: ModelConfig\.hidden_size=-3"),
                        ("- a\n- b\n", r"config\.yaml must hold a mapping of sections; got list")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            read_run_config(tmp_path)
