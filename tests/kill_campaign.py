"""SIGKILL campaign (issue 18): kill -9 at 10 points during index, corpus and HF saves and during training,
then reopen / resume and check that nothing was lost and no temporary folder is left.

    python -m tests.kill_campaign [--out DIR]

Save points (a child process pauses at the point, the parent SIGKILLs it): ``mid_write`` (the temporary
folder half written), ``before_swap`` (complete, not yet renamed), ``between_renames`` (the old folder
moved aside, the new one not yet in place), ``after_swap`` (new folder in place, old one not yet removed).
Expected on reopen: the old data (mid_write, before_swap) or the new data (between_renames, after_swap),
never a missing or mixed folder, and no ``.tmp-*`` / ``.old-*`` siblings.
Training points (``python -m train.train``, tiny config, 20 steps, checkpoints every 5): killed right after
the async save of step 10 starts, and killed inside step 13 of the resumed run; the final resume must
finish with parameters and losses bit-identical to an uninterrupted run.
Prints one table row per point; exits 1 if any point fails.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# The child: argv = point, path, seed, kind ("index" | "hf" | "corpus"). It pauses ("PAUSED" on stdout,
# then sleeps) at the point, so the parent's SIGKILL lands exactly there.
KILL_CHILD = r"""
import os, sys, time
import numpy as np
point, path, seed, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def pause():
    print("PAUSED", flush=True)
    time.sleep(120)
_rename = os.rename
def rename(src, dst):
    if point == "before_swap":  # the first rename of the swap
        pause()
    _rename(src, dst)
    if point == "between_renames" and ".old-" in str(dst):
        pause()
    if point == "after_swap" and ".tmp-" in str(src):
        pause()
os.rename = rename
if point == "mid_write":
    _save = np.save
    def save(f, *a, **k):
        _save(f, *a, **k)
        pause()
    np.save = save
if kind == "index":
    from rag_jax.retrieval.scann_index import ScannIndex
    index = ScannIndex(8)
    index.add(np.random.default_rng(seed).normal(size=(300, 8)).astype(np.float32), np.arange(300))
    index.save(path)
elif kind == "corpus":
    from rag_jax.retrieval.corpus import Corpus
    Corpus.from_documents([{"id": f"d{i}", "text": f"seed {seed} doc {i}"} for i in range(20)]).save(path)
else:
    from flax import nnx
    from rag_jax.model import ModelConfig
    from rag_jax.model.hf import save_hf
    from rag_jax.model.transformer import Transformer
    cfg = ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, max_seq_len=64)
    if point == "mid_write":
        import rag_jax.model.hf as hf
        _sf = hf.save_file
        def sf(*a, **k):
            _sf(*a, **k)
            pause()
        hf.save_file = sf
    save_hf(Transformer(cfg, rngs=nnx.Rngs(seed)), path)
print("DONE", flush=True)
"""


def kill_during_save(kind: str, point: str, path: Path, seed: int) -> None:
    """Run the save of ``kind`` ("index" / "hf" / "corpus") in a child and SIGKILL it at ``point``
    (``"none"``: let it finish)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-c", KILL_CHILD, point, str(path), str(seed), kind],
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline().strip()
        if point == "none":  # a complete save, no kill
            if line != "DONE" or p.wait() != 0:
                raise RuntimeError(f"the complete save failed (said {line!r})")
            return
        if line != "PAUSED":
            raise RuntimeError(f"child did not reach {point} (said {line!r})")
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def save_point(kind: str, point: str, work: Path) -> tuple[bool, str]:
    """Save seed 0, kill a save of seed 1 at ``point``, reopen: -> (ok, what was found)."""
    from flax import nnx

    from rag_jax.model import ModelConfig
    from rag_jax.model.hf import load_hf
    from rag_jax.model.transformer import Transformer
    from rag_jax.retrieval.corpus import Corpus
    from rag_jax.retrieval.scann_index import ScannIndex

    folder = work / f"{kind}-{point}"
    folder.mkdir()
    path = folder / kind
    cfg = ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, max_seq_len=64)

    def fingerprint(seed):
        if kind == "index":
            return np.random.default_rng(seed).normal(size=(300, 8)).astype(np.float32).tobytes()
        if kind == "corpus":
            return json.dumps([f"seed {seed} doc {i}" for i in range(20)])
        return np.asarray(Transformer(cfg, rngs=nnx.Rngs(seed)).embedding[...]).tobytes()

    def load():
        if kind == "index":
            return ScannIndex.load(path).store.vectors.tobytes()
        if kind == "corpus":
            return json.dumps([d.text for d in Corpus.load(path).documents])
        return np.asarray(load_hf(path)[1].embedding[...]).tobytes()

    kill_during_save(kind, "none", path, 0)  # a complete first save ("none": never pauses)
    kill_during_save(kind, point, path, 1)
    found = load()
    expected_new = point in ("between_renames", "after_swap")
    got = "new" if found == fingerprint(1) else "old" if found == fingerprint(0) else "neither"
    left = _leftovers(folder)
    ok = got == ("new" if expected_new else "old") and not left
    return ok, f"reloaded the {got} data; leftovers: {left or 'none'}"


KILL_DRIVER = """
import logging, os, signal, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # before orbax/absl
from rag_jax.train import checkpoint
at = int(os.environ["KILL_AT"])
_save = checkpoint.Checkpointer.save
def save(self, step, *args, **kwargs):
    if step == at and os.environ.get("KILL_BEFORE") == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # inside the step loop, between saves
    started = _save(self, step, *args, **kwargs)
    if step == at:
        os.kill(os.getpid(), signal.SIGKILL)  # the async write of this step is cut off
    return started
checkpoint.Checkpointer.save = save
from train.train import main
main(sys.argv[1:])
"""


def training_points(work: Path) -> list[tuple[str, bool, str]]:
    """Two kills in one run (during the step-10 save; inside step 13 after resuming), then a final resume."""
    from rag_jax.data.text_tfds import prepare_text_dataset

    data_dir = work / "tfds"
    prepare_text_dataset("phantom_wiki/articles_p60_s0", data_dir, 512)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_COMPILATION_CACHE_DIR=str(work / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

    def run(name, kill_at=None, before=False):
        out = work / name
        argv = ["--config", str(ROOT / "train" / "configs" / "tiny.yaml"), f"data.data_dir={data_dir}",
                f"train.run_dir={out}/run", f"checkpoint.dir={out}/ckpt", "train.steps=20", "train.log_every=1",
                "train.global_batch_size=8", "model.num_layers=1", "data.seq_len=64", "data.eval_batches=0",
                "optimizer.decay=constant", "optimizer.warmup_steps=2", "checkpoint.save_every=5",
                "checkpoint.keep=3", "logging.tensorboard=false", "logging.progress_bar=false"]
        cmd = [sys.executable, "-m", "train.train", *argv] if kill_at is None else \
            [sys.executable, "-c", KILL_DRIVER, *argv]
        run_env = dict(env, KILL_AT=str(kill_at or 0), KILL_BEFORE="1" if before else "0")
        done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, cwd=ROOT, timeout=600)
        with open(work / f"{name}.stderr", "a") as f:
            f.write(done.stderr)
        return done

    def losses(name):
        rows = [json.loads(line) for line in (work / name / "run" / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    def params(name):  # the step-20 parameters, restored onto this process's first device
        import jax
        import orbax.checkpoint as ocp
        path = work / name / "ckpt" / "20" / "state"
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                              ocp.StandardCheckpointHandler().metadata(path))
        tree = ocp.StandardCheckpointer().restore(path, target)
        return [np.asarray(x) for x in jax.tree.leaves(tree["params"])]

    ref = run("ref")
    assert ref.returncode == 0, ref.stderr[-2000:]
    rows = []
    first = run("killed", kill_at=10)
    resumed = run("killed", kill_at=13, before=True)
    m = re.search(r"resumed from checkpoint step (\d+)", resumed.stderr)
    rows.append(("train: SIGKILL as step 10's async save starts", first.returncode == -9 and m is not None,
                 f"rc={first.returncode}; next run resumed from step {m.group(1) if m else '?'}"))
    final = run("killed")
    m2 = re.search(r"resumed from checkpoint step (\d+)", final.stderr)
    same_params = final.returncode == 0 and all(np.array_equal(a, b) for a, b in zip(params("killed"), params("ref")))
    ref_l, got_l = losses("ref"), losses("killed")
    same_losses = all(got_l.get(s) == ref_l[s] for s in range(int(m2.group(1)) + 1 if m2 else 1, 21))
    ckpt = work / "killed" / "ckpt"
    tmp_left = [p.name for p in ckpt.iterdir() if "tmp" in p.name]
    rows.append(("train: SIGKILL inside step 13 after the resume",
                 resumed.returncode == -9 and same_params and same_losses and not tmp_left,
                 f"rc={resumed.returncode}; final run rc={final.returncode} resumed from step "
                 f"{m2.group(1) if m2 else '?'}; step-20 params identical to the uninterrupted run: {same_params}; "
                 f"losses identical: {same_losses}; temporary folders: {tmp_left or 'none'}"))
    return rows


POINTS = [("index", "mid_write"), ("index", "before_swap"), ("index", "between_renames"), ("index", "after_swap"),
          ("hf", "mid_write"), ("hf", "between_renames"), ("hf", "after_swap"), ("corpus", "between_renames")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="work folder (default: a temporary one, removed afterwards)")
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--skip-saves", action="store_true")
    args = p.parse_args(argv)
    work = Path(args.out or tempfile.mkdtemp(prefix="rag_jax_kill_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for kind, point in [] if args.skip_saves else POINTS:
            ok, what = save_point(kind, point, work)
            rows.append((f"{kind} save: {point}", ok, what))
            print(f"| {rows[-1][0]} | {'ok' if ok else 'FAIL'} | {what} |", flush=True)
        if not args.skip_training:
            for row in training_points(work):
                rows.append(row)
                print(f"| {row[0]} | {'ok' if row[1] else 'FAIL'} | {row[2]} |", flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    passed = sum(ok for _, ok, _ in rows)
    print(f"{passed}/{len(rows)} kill points: no data lost, no temporary folder left")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
