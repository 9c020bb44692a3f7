"""The Colab notebooks run top to bottom (nbclient, a real Jupyter kernel) at toy sizes.

The notebooks read ``RAG_JAX_NOTEBOOK_TEST=1`` and then use ``train/configs/demo_tiny.yaml``-sized runs;
each test also checks what the notebook printed, so a cell that runs but computes nothing fails.
"""
import os
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
