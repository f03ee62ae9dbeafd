"""Trains a DiffusionGemma-style model from a config file.

  python train.py --config=configs/demo.py --workdir=workdirs/demo
  python train.py --config=configs/demo.py --workdir=workdirs/demo --config.opt.lr=3e-4 --config.train.num_steps=500

Re-running with the same --workdir resumes from the latest checkpoint (params, optimizer state,
step and data-iterator position); a config that changes the architecture is refused before anything is
written (dgemma/train/loop.py lists what is checked).

Multi-process (one process per host, or several on one host): every process runs the same command
with its own --process_id; each reads its own shard of the data.

  python train.py --config=configs/demo.py --workdir=/shared/w --coordinator_address=host0:1234 \\
      --num_processes=2 --process_id=0        # and --process_id=1 on the other process

The three flags can come from $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and $JAX_PROCESS_ID instead;
--num_processes=0 lets JAX detect the cluster (SLURM, Open MPI, TPU pods).
"""

from absl import flags
from ml_collections import config_flags

from dgemma import distributed
from dgemma.tools import cli
from dgemma.train import loop

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, config.json, metrics and TensorBoard events.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run (0 = detect).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  cli.no_extra_args(argv)
  config = cli.config(_CONFIG)
  distributed.init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  loop.train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main, "train.py")
