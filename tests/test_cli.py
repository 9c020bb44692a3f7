"""``rag-jax`` verbs: eval / bench dispatch to rag_jax.evaluation / rag_jax.benchmarks (``--help`` only: fast)."""
import subprocess
import sys

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
    assert "valid: attention, em_llm_bench" in capsys.readouterr().err


@pytest.mark.parametrize("verb,name", [("bench", n) for n in cli.BENCHES] + [("eval", n) for n in cli.EVALS])
def test_script_help(verb, name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([verb, name, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: rag-jax {verb} {name}")


def test_python_m_rag_jax_dispatches():
    """``python -m rag_jax`` (rag_jax/__main__.py) is ``rag-jax``; ``train`` passes its arguments through."""
    r = subprocess.run([sys.executable, "-m", "rag_jax", "train", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: rag-jax train")


@pytest.mark.parametrize("verb,usage", [("index", "build"), ("search", "query")])
def test_index_and_search_reach_the_retrieval_cli(verb, usage, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([verb, "--help"])
    assert e.value.code == 0 and usage in capsys.readouterr().out.splitlines()[0]
