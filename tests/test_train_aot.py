"""TPU ahead-of-time compilation of the sharded train step on this CPU-only machine (rag_jax/train/aot.py).

Needs libtpu (`pip install -e ".[tpu]"`, i.e. jax[tpu]); no TPU hardware.
"""
from pathlib import Path

import pytest

from rag_jax.train import aot
from rag_jax.train.trainer import load_run_config

pytest.importorskip("libtpu", reason='TPU AOT compile needs libtpu: pip install -e ".[tpu]" (no TPU needed)')

TINY = Path(__file__).resolve().parents[1] / "train" / "configs" / "tiny.yaml"


@pytest.fixture(autouse=True)
def _compile_only_libtpu(monkeypatch):
    # libtpu otherwise probes for a local TPU VM (metadata server, worker hostnames)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no exclusive /tmp/libtpu_lockfile: nothing runs on a TPU


def test_sharded_step_compiles_for_v5p_2x2x2():
    cfg = load_run_config(TINY, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.global_batch_size=8"])
    report = aot.aot_memory_report(cfg, "v5p:2x2x2")
    assert report.num_chips == 8 and report.hbm == 95 * aot.GiB
    # params + AdamW moments of the tiny model, fp32, split 8 ways (2-way replicated over data): about
    # 3 copies x 4 bytes x ~100k params / 4 per chip, far below 10 MiB
    assert 0 < report.arguments < 10 * 2**20 and report.temporaries > 0
    assert report.aliased > 0  # the donated state is updated in place
    assert "fits: yes" in report.table()


def test_step_that_cannot_fit_is_reported():
    # Dense attention holds [q, kv] logits: at 64K tokens they cannot fit (blockwise would).
    cfg = load_run_config(TINY, ["model.max_seq_len=65536", "data.seq_len=65536", "train.global_batch_size=4",
                                 "model.attention_impl=dense"])
    with pytest.raises(aot.DoesNotFitError, match=r"does not fit in 16 GiB HBM per chip|needs .* GiB per chip"):
        aot.aot_memory_report(cfg, "v5e:2x2")


def test_bad_topology_and_mesh():
    with pytest.raises(ValueError, match="topology 'v9x:2x2'"):
        aot.topology_devices("v9x:2x2")
    cfg = load_run_config(TINY, ["mesh.data=3", "mesh.fsdp=1"])
    with pytest.raises(ValueError, match="has 3 devices but 8 are available"):
        aot.aot_memory_report(cfg, "v5p:2x2x2")
