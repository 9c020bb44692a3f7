"""``rag-jax`` verbs: eval / bench dispatch to the recipes, rag_jax.evaluation and rag_jax.benchmarks (``--help`` only: fast)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rag_jax import cli


def test_eval_help_lists_names(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.EVALS)


def test_unknown_name_is_one_line_error(capsys):
    assert cli.main(["eval", "nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nosuch" in err and all(name in err for name in cli.EVALS)
    assert cli.main(["bench", "block_quality"]) == 2       # an eval name is not a bench
    assert "valid: " + ", ".join(sorted(cli.BENCHES)) in capsys.readouterr().err


@pytest.mark.parametrize("verb,name", [("bench", n) for n in cli.BENCHES] + [("eval", n) for n in cli.EVALS])
def test_script_help(verb, name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([verb, name, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: rag-jax {verb} {name}")


def test_script_files_are_the_cli():
    """``eval/NAME.py`` and ``bench/NAME.py`` exist for exactly the CLI's names, import without running (a
    ``__main__`` guard) and, run as scripts, are ``rag-jax eval|bench NAME``."""
    import importlib.util
    repo = Path(__file__).resolve().parents[1]
    for verb in ("eval", "bench"):
        assert sorted(p.stem for p in (repo / verb).glob("*.py")) == sorted(cli.SCRIPTS[verb])
        for name in cli.SCRIPTS[verb]:
            spec = importlib.util.spec_from_file_location(f"_script_{verb}_{name}", repo / verb / f"{name}.py")
            spec.loader.exec_module(importlib.util.module_from_spec(spec))   # no SystemExit: nothing runs
    r = subprocess.run([sys.executable, str(repo / "eval" / "block_nq.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: rag-jax eval block_nq")


def test_python_m_rag_jax_dispatches():
    """``python -m rag_jax`` (rag_jax/__main__.py) is ``rag-jax``; ``train`` passes its arguments through."""
    r = subprocess.run([sys.executable, "-m", "rag_jax", "train", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: rag-jax train")


def test_console_script_runs_under_the_malloc_environment(monkeypatch):
    """``entry`` (the ``rag-jax`` script, ``python -m rag_jax``) re-executes the same command line once with
    ``MALLOC_ENV`` set, then runs ``main``; ``RAG_JAX_MALLOC=0`` skips it. In a real process: the child sees it."""
    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)) or sys.exit(7))
    monkeypatch.setattr(cli, "main", lambda: 0)
    monkeypatch.setattr(sys, "platform", "linux")
    for k in cli.MALLOC_ENV:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as e:
        cli.entry()
    assert e.value.code == 7 and calls[0][:2] == (sys.executable, list(sys.orig_argv))
    assert all(calls[0][2][k] == v for k, v in cli.MALLOC_ENV.items())
    for env in (cli.MALLOC_ENV, {"RAG_JAX_MALLOC": "0"}):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            with pytest.raises(SystemExit) as e:
                cli.entry()
        assert e.value.code == 0 and len(calls) == 1
    # python -c PROBE: prints the variable, then runs rag_jax's __main__, which re-executes PROBE once
    probe = ("import os, runpy, sys; print(os.environ.get('MALLOC_MMAP_THRESHOLD_')); "
             "sys.argv = ['rag-jax', 'smoke', '--help']; runpy.run_module('rag_jax', run_name='__main__')")
    if sys.platform == "linux":
        env = {k: v for k, v in os.environ.items() if k not in cli.MALLOC_ENV and k != "RAG_JAX_MALLOC"}
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
        assert r.stdout.splitlines()[:2] == ["None", cli.MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]], r.stdout[:300]


@pytest.mark.parametrize("verb,usage", [("index", "build"), ("search", "query")])
def test_index_and_search_reach_the_retrieval_cli(verb, usage, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([verb, "--help"])
    assert e.value.code == 0 and usage in capsys.readouterr().out.splitlines()[0]


# ---------------------------------------------------------------------------------------------
# Bad input to every eval and bench script (issue 18): one line on stderr naming the argument, exit
# status 2, nothing written. In-process and stopped at argument parsing, so no model or data loads.
# "{tmp}" is the test's folder (the working directory), holding "a_folder/" and "notes.txt".

BAD_SCRIPT_INPUT = [
    # (verb, script, arguments, the argument the error must name)
    ("eval", "block_nq", ["--data", "{tmp}/missing.jsonl.gz"], "--data"),
    ("eval", "block_nq", ["--limit", "-3"], "--limit"),
    ("eval", "block_nq", ["--heldout", "nan"], "--heldout"),
    ("eval", "block_nq", ["--positions", "0,x"], "--positions"),
    ("eval", "block_nq", ["--modes", "block,causal"], "--modes"),
    ("eval", "block_nq", ["--model", "no-such-model"], "--model"),
    ("eval", "block_nq", ["--out", "{tmp}/a_folder"], "--out"),
    ("eval", "block_nq", ["--finetune-steps", "-1"], "--finetune-steps"),
    ("eval", "block_nq", ["--lr", "inf"], "--lr"),
    ("eval", "block_nq", ["--train-seq-len", "4"], "--train-seq-len"),
    ("eval", "block_distill", ["--ll-rows", "1"], "--ll-rows"),
    ("eval", "block_distill", ["--ll-rows", "100000"], "--ll-rows"),
    ("eval", "block_distill", ["--em-questions", "100000"], "--em-questions"),
    ("eval", "block_distill", ["--prefix", "sink,nosuch"], "--prefix"),
    ("eval", "block_distill", ["--train-prefix", "first"], "--train-prefix"),
    ("eval", "block_distill", ["--passage-temperature", "0.8,0"], "--passage-temperature"),
    ("eval", "block_distill", ["--full-weight", "-1"], "--full-weight"),
    ("eval", "block_distill", ["--top-layers", "30"], "--top-layers"),
    ("eval", "block_distill", ["--lr", "nan"], "--lr"),
    ("eval", "block_distill", ["--train-max-passage", "8"], "--train-max-passage"),
    ("eval", "block_distill", ["--flat-block-pass", "--train-prefix", "sink"], "--flat-block-pass"),
    ("eval", "block_distill", ["--lora-rank", "-2"], "--lora-rank"),
    ("eval", "block_distill", ["--tuned", "smollm2-135m-instruct-block", "--steps", "3"], "--tuned"),
    ("eval", "grit_pretrained", ["--modes", "unified,nosuch"], "--modes"),
    ("eval", "grit_pretrained", ["--temperature", "0"], "--temperature"),
    ("eval", "grit_pretrained", ["--steps", "1.5"], "--steps"),
    ("eval", "grit_pretrained", ["--data", "{tmp}/a_folder"], "--data"),
    # a generative row's prompt longer than --gen-len: found after loading the model (SmolLM2), before training
    ("eval", "grit_pretrained", ["--gen-len", "16", "--gen-targets", "gold", "--eval-questions", "2",
                                 "--train-questions", "4", "--gen-train", "2", "--pool", "8", "--no-minilm",
                                 "--cache-dir", "{tmp}/grit"], "--gen-len"),
    ("eval", "long_context", ["--rag-top-k", "0"], "--rag-top-k"),
    ("eval", "long_context", ["--task", "nosuch"], "--task"),
    ("eval", "needles", ["--dicts", "60,20"], "--dicts"),
    ("eval", "needles", ["--lora-rank", "-1"], "--lora-rank"),
    ("eval", "rag_scaling", ["--data", "{tmp}/missing"], "--data"),
    ("eval", "rag_scaling", ["--generate", "1", "--ks", "0,x"], "--ks"),
    ("eval", "rag_scaling", ["--generate", "1", "--steps", "1"], "--steps"),
    ("eval", "rag_scaling", ["--generate", "1", "--ragged", "dense"], "--ragged"),
    ("eval", "sparse_rag", ["--generate", "1", "--keep", "0,2"], "--keep"),
    ("eval", "sparse_rag", ["--data", "{tmp}/missing"], "--data"),
    ("eval", "sparse_rag", ["--generate", "1", "--lora-rank", "-1"], "--lora-rank"),
    ("eval", "sparse_rag", ["--generate", "1", "--num-passages", "1"], "--num-passages"),
    ("eval", "sparse_rag", ["--nq", "{tmp}/missing.jsonl.gz"], "--nq"),
    ("eval", "rapid", ["--etas", "0,-1"], "--etas"),
    ("eval", "rapid", ["--task", "kv"], "--task"),
    ("eval", "rapid", ["--gamma", "0"], "--gamma"),
    ("eval", "rapid", ["--target", "sliding"], "--target"),
    ("eval", "rapid", ["--target", "em_llm", "--set", "nosuch_key=1"], "nosuch_key"),
    ("eval", "needles", ["--variants", "simple,tree"], "--variants"),
    ("eval", "needles", ["--steps", "-1"], "--steps"),
    ("eval", "needles", ["--tuned", "{tmp}/notes.txt"], "--tuned"),
    ("eval", "long_context", ["--max-new-tokens", "0"], "--max-new-tokens"),
    ("eval", "block_quality", ["--config", "{tmp}/missing.yaml"], "--config"),
    ("eval", "block_quality", ["--model", "{tmp}/missing_run"], "--model"),
    ("eval", "block_quality", ["--out", "{tmp}/notes.txt/x.json"], "--out"),
    ("eval", "block_quality", ["train.steps=-5"], "train.steps"),
    ("eval", "grit_eval", ["--modes", "embedding,nosuch"], "--modes"),
    ("eval", "grit_eval", ["--config", "{tmp}/a_folder"], "--config"),
    ("eval", "grit_eval", ["--json", "{tmp}/a_folder"], "--json"),
    ("eval", "grit_eval", ["train.steps=nan"], "train.steps"),
    ("eval", "long_context", ["--lengths", "2048", "0"], "--lengths"),
    ("eval", "long_context", ["--samples", "2.5"], "--samples"),
    ("eval", "long_context", ["--methods", "em_llm", "nosuch"], "--methods"),
    ("eval", "long_context", ["--model", "{tmp}/notes.txt"], "--model"),
    ("eval", "long_context", ["--em-config", "{tmp}/missing.yaml"], "--em-config"),
    ("eval", "long_context", ["--set", "nosuch_key=1"], "nosuch_key"),
    ("eval", "passkey", ["--lr", "nan"], "--lr"),
    ("eval", "passkey", ["--train-len", "5000"], "--train-len"),
    ("eval", "passkey", ["--methods", "nosuch"], "--methods"),
    ("eval", "passkey", ["--init-from", "{tmp}/missing_model"], "--init-from"),
    ("eval", "passkey", ["--model", "{tmp}/notes.txt"], "--model"),
    ("eval", "passkey", ["--samples", "-1"], "--samples"),
    ("eval", "rag_qa", ["--model", "{tmp}/missing_run", "--data", "{tmp}/a_folder"], "--model"),
    ("eval", "rag_qa", ["--model", "{tmp}/a_folder", "--data", "{tmp}/missing"], "--data"),
    ("eval", "rag_qa", ["--model", "{tmp}/a_folder", "--data", "{tmp}/a_folder", "--limit", "-1"], "--limit"),
    ("eval", "rag_qa", ["--model", "{tmp}/a_folder", "--data", "{tmp}/a_folder", "--retriever", "bm25"],
     "--retriever"),
    ("eval", "retrieval_nq", ["--data", "{tmp}/missing.jsonl.gz"], "--data"),
    ("eval", "retrieval_nq", ["--target-recall", "1.5"], "--target-recall"),
    ("eval", "retrieval_nq", ["--limit", "0"], "--limit"),
    ("eval", "retrieval_nq", ["--cache", "{tmp}/a_folder"], "--cache"),
    ("eval", "retrieval_recall", ["--data", "{tmp}/missing"], "--data"),
    ("eval", "retrieval_recall", ["--data", "{tmp}/a_folder", "--ks", "1,x"], "--ks"),
    ("eval", "retrieval_recall", ["--data", "{tmp}/a_folder", "--questions", "nosuch"], "--questions"),
    ("eval", "retrieval_recall", ["--data", "{tmp}/a_folder", "--max-hops", "-1"], "--max-hops"),
    ("bench", "attention", ["--impls", "dense,nosuch"], "--impls"),
    ("bench", "attention", ["--sizes", "1024,abc"], "--sizes"),
    ("bench", "attention", ["--repeats", "0"], "--repeats"),
    ("bench", "attention", ["--model", "no-such-model"], "--model"),
    ("bench", "em_llm_bench", ["--preset", "nosuch"], "--preset"),
    ("bench", "em_llm_bench", ["--lengths", "-5"], "--lengths"),
    ("bench", "em_llm_bench", ["--skip", "nosuch"], "--skip"),
    ("bench", "em_llm_bench", ["--em-config", "{tmp}/missing.yaml"], "--em-config"),
    ("bench", "em_llm_bench", ["--model", "no-such-model"], "--model"),
    ("bench", "em_llm_bench", ["--threads", "-2"], "--threads"),
    ("bench", "grit_caching", ["--modes", "nosuch"], "--modes"),
    ("bench", "grit_caching", ["--sizes", "nan"], "--sizes"),
    ("bench", "grit_caching", ["--dtype", "int8"], "--dtype"),
    ("bench", "grit_caching", ["--repeats", "1.5"], "--repeats"),
    ("bench", "grit_caching", ["--model", "no-such-model"], "--model"),
    ("bench", "grit_caching", ["--model", "{tmp}/a_folder"], "--model"),
    ("bench", "grit_caching", ["--threads", "-1"], "--threads"),
    ("bench", "grit_caching", ["--clock", "gpu"], "--clock"),
    ("bench", "grit_caching", ["--model", "smollm2-135m-instruct", "--sizes", "9000"], "--sizes"),
    ("bench", "load_and_speed", ["--model", "no-such-model"], "--model"),
    ("bench", "load_and_speed", ["--model", "{tmp}/a_folder"], "--model"),
    ("bench", "load_and_speed", ["--lengths", "2.5"], "--lengths"),
    ("bench", "load_and_speed", ["--iters", "0"], "--iters"),
    ("bench", "magicpig", ["--lsh", "10"], "--lsh"),
    ("bench", "magicpig", ["--lsh", "10:150", "0:4"], "--lsh"),
    ("bench", "magicpig", ["--lengths", "4096,100"], "--lengths"),
    ("bench", "magicpig", ["--samples", "0"], "--samples"),
    ("bench", "magicpig", ["--gather", "-1"], "--gather"),
    ("bench", "magicpig", ["--base", "paged"], "--base"),
    ("bench", "magicpig", ["--base", "em_llm", "--set", "n_mem=-4"], "n_mem"),
    ("bench", "magicpig", ["--model", "no-such-model"], "--model"),
    ("bench", "model_vs_torch", ["--lr", "nan"], "--lr"),
    ("bench", "model_vs_torch", ["--batch", "-1"], "--batch"),
    ("bench", "model_vs_torch", ["--iters", "1.5"], "--iters"),
    ("bench", "model_vs_torch", ["--layers", "2", "--train-top", "3"], "--train-top"),
    ("bench", "retrieval_bench", ["--sizes", "-5"], "--sizes"),
    ("bench", "retrieval_bench", ["--target-recall", "nan"], "--target-recall"),
    ("bench", "retrieval_bench", ["--k", "0"], "--k"),
    ("bench", "retrieval_bench", ["--cluster-std", "inf"], "--cluster-std"),
    ("bench", "retrieval_bench", ["--sizes", "5", "--k", "10"], "--k"),
    ("bench", "train_bench", ["--preset", "nosuch"], "--preset"),
    ("bench", "train_bench", ["--remat", "none", "nosuch"], "--remat"),
    ("bench", "train_bench", ["--peak_flops", "nan"], "--peak_flops"),
    ("bench", "train_bench", ["--steps", "0"], "--steps"),
    ("bench", "ttft", ["--sizes", "1024,x"], "--sizes"),
    ("bench", "ttft", ["--preset", "nosuch"], "--preset"),
    ("bench", "ttft", ["--dtype", "int8"], "--dtype"),
    ("bench", "ttft", ["--model", "no-such-model"], "--model"),
    ("bench", "ttft", ["--last_len", "-1"], "--last_len"),
    ("bench", "ttft", ["--rounds", "0"], "--rounds"),
    ("bench", "ttft", ["--sizes", "40", "--last_len", "50"], "--sizes"),
    ("bench", "accelerator", ["--steps", "nosuch", "--out", "{tmp}/a.json"], "--steps"),
    ("bench", "accelerator", ["--out", "{tmp}/a.json"], "--cpu-smoke"),          # the full run needs a GPU
    ("bench", "scan_layers", ["--layers", "0"], "--layers"),
    ("bench", "scan_layers", ["--seq", "0"], "--seq"),
    ("bench", "scan_layers", ["--remat", "nosuch"], "--remat"),
    ("bench", "scan_layers", ["--speed", "--steps", "0"], "--steps"),
    ("bench", "scan_layers", ["--heads", "9", "--kv-heads", "2"], "num_kv_heads"),
]


# cases that read ../shared/data before they reach the checked flag (skipped where it is absent)
NEEDS_SHARED_DATA = {("grit_pretrained", "--gen-len"), ("block_distill", "--ll-rows"), ("block_distill", "--em-questions"),
                     ("block_distill", "--top-layers"), ("block_distill", "--tuned")}
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"   # as conftest.SHARED_DATA


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("verb,name,argv,flag", BAD_SCRIPT_INPUT,
                         ids=[f"{v}-{n}-{' '.join(a).replace('{tmp}/', '')}" for v, n, a, _ in BAD_SCRIPT_INPUT])
def test_bad_script_input_is_one_line_naming_it(verb, name, argv, flag, tmp_path, monkeypatch, capsys):
    if (name, flag) in NEEDS_SHARED_DATA and not SHARED_DATA.is_dir():
        pytest.skip(f"needs the shared data folder {SHARED_DATA} (absent)")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "notes.txt").write_text("user data")
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    try:
        code = cli.main([verb, name, *(a.format(tmp=tmp_path) for a in argv)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0 and "error:" in err and flag in err, err
    assert "Traceback" not in err
    assert _files(tmp_path) == before
    assert (tmp_path / "notes.txt").read_text() == "user data"


def test_bad_script_input_counts():
    """Every eval and bench script has bad-input cases above (the issue note counts them)."""
    assert {n for _, n, _, _ in BAD_SCRIPT_INPUT} == set(cli.EVALS) | set(cli.BENCHES)
    assert len(BAD_SCRIPT_INPUT) >= 60


def test_list_options_take_commas_spaces_or_both():
    """One list grammar: an option declared with a list type, or with ``nargs="+"`` and an item type or choices,
    takes ``a,b c`` and ``a b,c`` alike; a bad item is the one-line error naming the option."""
    from rag_jax.args import ScriptParser, int_list, integer
    rng = np.random.default_rng()
    a, b, c = (int(x) for x in rng.integers(1, 10_000, 3))
    p = ScriptParser(prog="t")
    p.add_argument("--lengths", type=integer(1), nargs="+", default=[7])
    p.add_argument("--sizes", type=int_list(1), default="3,4")
    p.add_argument("--methods", nargs="+", default=["x"], choices=["x", "y", "z"])
    for tokens in ([f"{a},{b}", str(c)], [str(a), f"{b},{c}"], [f"{a},{b},{c}"], [str(a), str(b), str(c)]):
        got = p.parse_args(["--lengths", *tokens, "--sizes", *tokens, "--methods", "y,z", "x"])
        assert got.lengths == got.sizes == [a, b, c] and got.methods == ["y", "z", "x"]
    assert (p.parse_args([]).lengths, p.parse_args([]).sizes) == ([7], [3, 4])
    with pytest.raises(SystemExit):
        p.parse_args(["--lengths", f"{a},0"])
    with pytest.raises(SystemExit):
        p.parse_args(["--methods", "x,w"])
