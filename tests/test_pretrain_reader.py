"""``train/pretrain_reader.py`` (the demo's reader base): rows, export and resume at toy size."""
import json
import random

import numpy as np
import pytest

from train import pretrain_reader as pr


def test_rows_hold_the_gold_passage_and_answer_spans():
    args = pr.parse_args(["--out", "x", "--steps", "10", "--max-passages", "3", "--seq-len", "512"])
    u = pr.Universe(100, 60)
    rng = random.Random(0)
    for q in u.questions[:20]:
        chosen, earlier = u.row(q, 3, 4, rng)
        assert q["gold"][0] in chosen and len(set(chosen)) == 3 and len(earlier) <= 3
        assert all(set(o["gold"]) <= set(chosen) for o in earlier)
    from rag_jax.tokenizer import train_bpe
    tok = train_bpe([a["article"] for a in u.articles], 400)
    early = pr.make_batch(tok, [u], 0, args, {})      # first half: the gold passage alone
    late = pr.make_batch(tok, [u], 9, args, {})
    n_blocks = lambda b: [len(set(r[r > 0].tolist())) for r in b["segment_ids"]]
    assert max(n_blocks(early)) == 2 and max(n_blocks(late)) >= 3
    # Answer tokens weigh --answer-weight, passage tokens --passage-weight, the question nothing.
    assert set(np.unique(early["loss_mask"]).tolist()) <= {0.0, np.float32(args.passage_weight), args.answer_weight}
    assert ((early["loss_mask"] == args.answer_weight) & ~early["is_global"]).sum() == 0
    np.testing.assert_array_equal(pr.make_batch(tok, [u], 9, args, {})["tokens"], late["tokens"])  # step-determined


@pytest.mark.slow
def test_pretrain_exports_hf_folder_and_resumes(tmp_path, capsys):
    from rag_jax.model.hf import load_hf
    out = tmp_path / "base"
    common = ["--out", str(out), "--people", "40", "--universes", "1", "--hidden", "32", "--layers", "1",
              "--vocab", "300", "--batch", "2", "--eval-every", "2", "--seq-len", "512", "--eval-questions", "6"]
    assert pr.main(common + ["--steps", "2"]) == 0
    cfg, _, _ = load_hf(out)
    assert cfg.num_layers == 1 and (out / "tokenizer.json").is_file()
    info = json.loads((out / "reader.json").read_text())
    assert [h["step"] for h in info["history"]] == [2] and 0 <= info["history"][0]["gold"] <= 1
    assert pr.main(common + ["--steps", "3"]) == 0     # resumes from the step-2 checkpoint
    assert "resumed at step 2" in capsys.readouterr().out
    assert [h["step"] for h in json.loads((out / "reader.json").read_text())["history"]] == [3]


def test_shipped_reader_base_can_be_rewritten_and_ships_whole():
    """``pretrain_reader.py --out rag_jax/assets/demo_reader`` is accepted (the folder carries the writer's
    marker listing exactly its files), and every file, the marker included, is package data (setuptools
    expands the patterns with ``glob``, whose "*" skips dot files)."""
    import glob
    import tomllib
    from pathlib import Path

    from rag_jax import atomic
    package = Path(atomic.__file__).parent
    asset = package / "assets" / "demo_reader"
    files = {p.name for p in asset.iterdir()}
    assert atomic.read_marker(asset) == {"kind": "rag_jax.folder", "files": files}
    atomic.check_target(asset, "rag_jax.folder")  # raises TargetExistsError if the writer would refuse it
    patterns = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {Path(f).name for pattern in patterns["rag_jax"] for f in glob.glob(pattern, root_dir=package)
               if Path(f).parent == Path("assets/demo_reader")}
    assert shipped == files and atomic.MARKER in shipped
