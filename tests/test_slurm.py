"""The launchers for real: ``sbatch train/launch_slurm.sh`` on a one-node SLURM cluster started by the fixture
(Debian's ``slurm-wlm`` and ``munge``, installed by ``.ci/run``): a 2-task CPU job (``srun``, ``jax.distributed``
reading the SLURM environment, gloo collectives) trains like one process with the same global devices; and the
TPU pod launcher's dry run (the command each worker would get)."""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rag_jax import distributed
from rag_jax.data.text_tfds import prepare_text_dataset
from rag_jax.train import metrics as metrics_lib

ROOT = Path(__file__).resolve().parents[1]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")

CONF = """ClusterName=ragjax
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """slurmctld + slurmd (+ munged if not running) on this machine with a private config; torn down after."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing or os.geteuid() != 0:
        pytest.skip(f"a local SLURM cluster needs root and slurm-wlm + munge (apt-get install slurm-wlm munge); "
                    f"missing: {missing or 'root'}")
    tmp = tmp_path_factory.mktemp("slurm")
    for d in ("state", "spool"):
        (tmp / d).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = tmp / "slurm.conf"
    conf.write_text(CONF.format(host=host, tmp=tmp, ctld_port=_free_port(), slurmd_port=_free_port(),
                                cpus=os.cpu_count()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["munged", "--force"], check=True, capture_output=True)
    daemons = [subprocess.Popen([d, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for d in ("slurmctld", "slurmd")]
    try:
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                           text=True).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the SLURM node did not come up: {(tmp / 'slurmctld.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield {"env": env, "tmp": tmp}
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            d.wait(30)


def _overrides(data_dir, out):
    return [f"data.data_dir={data_dir}", f"train.run_dir={out}/run", f"checkpoint.dir={out}/ckpt", "train.steps=4",
            "train.log_every=1", "train.global_batch_size=8", "model.num_layers=1", "data.seq_len=64",
            "data.num_shards=2", "data.eval_batches=0", "optimizer.decay=constant", "optimizer.warmup_steps=2",
            "checkpoint.save_every=4", "logging.tensorboard=false", "logging.progress_bar=false"]


def _losses(path):
    return [r["train/loss"] for r in metrics_lib.read_jsonl(path) if "train/loss" in r]


def test_sbatch_two_task_job_equals_one_process(cluster, tmp_path):
    data_dir = tmp_path / "tfds"
    prepare_text_dataset("phantom_wiki/articles_p60_s0", data_dir, 512)
    config = str(ROOT / "train" / "configs" / "tiny.yaml")
    job_env = {**cluster["env"], "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    out = tmp_path / "slurm"
    start = time.monotonic()
    job = subprocess.run(["sbatch", "--wait", "--ntasks=2", "--cpus-per-task=1", f"--output={tmp_path}/job.out",
                          f"--chdir={ROOT}", str(ROOT / "train" / "launch_slurm.sh"), "--config", config,
                          *_overrides(data_dir, out)], env=job_env, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert job.returncode == 0, f"sbatch rc={job.returncode}: {job.stderr}\n{log[-4000:]}"
    assert log.count("done: step 4") == 2, log[-4000:]   # both tasks finished the run
    seconds = time.monotonic() - start
    ref, = distributed.launch_local([sys.executable, "-m", "train.train", "--config", config,
                                     *_overrides(data_dir, tmp_path / "ref")], 1, 4, timeout_s=300,
                                    env={"PYTHONPATH": job_env["PYTHONPATH"]})
    got, want = _losses(out / "run" / "metrics.jsonl"), _losses(tmp_path / "ref" / "run" / "metrics.jsonl")
    assert len(got) == len(want) == 4
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert (out / "ckpt" / "4").is_dir()                 # the two tasks wrote one multi-host checkpoint
    print(f"SLURM job: {seconds:.0f} s")


def test_tpu_pod_launcher_dry_run_issues_one_command_per_worker_with_args_intact():
    """``DRY_RUN=1 train/launch_tpu_pod.sh``: the gcloud command it would issue (every worker, the same training
    command); an override with a space reaches the remote shell as one argument."""
    import shlex

    args = ["--config", "train/configs/llama3_8b_v5p.yaml", "data.data_dir=gs://b/my dir", "checkpoint.dir=gs://b/c"]
    run = subprocess.run(["bash", str(ROOT / "train" / "launch_tpu_pod.sh"), *args], capture_output=True, text=True,
                         env={**os.environ, "DRY_RUN": "1", "TPU_NAME": "pod-1", "ZONE": "us-east5-a"}, timeout=30)
    assert run.returncode == 0, run.stderr
    argv = shlex.split(run.stdout)
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-1"]
    assert "--worker=all" in argv and argv[argv.index("--zone") + 1] == "us-east5-a"
    remote = shlex.split(argv[argv.index("--command") + 1])
    assert remote[:7] == ["cd", "~/rag-jax", "&&", "python", "-m", "train.train", "--auto_distributed"]
    assert remote[7:] == args
    missing = subprocess.run(["bash", str(ROOT / "train" / "launch_tpu_pod.sh")], capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k not in ("TPU_NAME", "ZONE")}, timeout=30)
    assert missing.returncode != 0 and "set TPU_NAME" in missing.stderr
