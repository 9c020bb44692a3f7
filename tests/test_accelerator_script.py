"""``rag-jax bench accelerator --cpu-smoke``: the GPU script's steps run at toy size on CPU and write one JSON; the
cuDNN mapping check agrees with the dense reference to bf16 rounding; the full run refuses a machine with no GPU."""
import json

import pytest

from rag_jax.benchmarks import accelerator


def test_cpu_smoke_writes_one_json_with_every_step_checked(tmp_path):
    out = tmp_path / "acc.json"
    assert accelerator.main(["--cpu-smoke", "--steps", "cudnn", "prefill", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cpu_smoke"] and set(result["steps"]) == {"cudnn", "prefill"}
    cudnn = result["steps"]["cudnn"]
    assert cudnn["ok"] and cudnn["path"] == "xla mapping"
    assert cudnn["max_abs_err_out"] <= 0.02 * cudnn["scale_out"]      # bf16 inputs: rounding only
    assert 0 < cudnn["max_abs_err_grads"] < 0.1
    assert result["steps"]["prefill"]["tokens"] == 512 and result["steps"]["prefill"]["tokens_per_s"] > 0


def test_full_run_needs_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit):
        accelerator.main(["--out", str(tmp_path / "x.json")])
    assert "needs a GPU" in capsys.readouterr().err
