"""Writes documents of a seeded order-k character Markov chain, with their exact bits per byte.

  python -m proj.markov.make_text --out_dir=data_cache/markov --num_train=4000 --num_valid=64 \\
      --length=1000 --order=2 --concentration=0.1 --seed=0

out_dir/train.txt and out_dir/valid.txt hold one document per line (data.txt_mode='line'); out_dir/truth.json
holds the chain's entropy rate and the exact bits per byte of each file (proj/markov/data.py). Train and
validation documents come from independent seed streams. Then, for example:

  python train.py --config=proj/markov/configs/likelihood_small.py:data_cache/markov/train.txt --workdir=workdirs/markov
  python -m eval.likelihood --checkpoint=workdirs/markov --data=data_cache/markov/valid.txt
"""

import time

from absl import flags

from proj.markov import data as markov
from dgemma.tools import cli

_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory for train.txt, valid.txt and truth.json.", required=True)
_NUM_TRAIN = flags.DEFINE_integer("num_train", 4000, "Training documents.", lower_bound=1)
_NUM_VALID = flags.DEFINE_integer("num_valid", 64, "Validation documents.", lower_bound=1)
_LENGTH = flags.DEFINE_integer("length", 1000, "Characters per document.", lower_bound=1)
_ORDER = flags.DEFINE_integer("order", 2, "Markov order (symbols of context).", lower_bound=0)
_CONCENTRATION = flags.DEFINE_float("concentration", 0.1, "Dirichlet concentration of each transition row.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the chain and of the documents.")


def main(argv):
  cli.no_extra_args(argv)
  start = time.perf_counter()
  truth = markov.write_splits(_OUT_DIR.value, num_train=_NUM_TRAIN.value, num_valid=_NUM_VALID.value,
                              length=_LENGTH.value, order=_ORDER.value, concentration=_CONCENTRATION.value,
                              seed=_SEED.value)
  print(f"wrote {truth['train_documents']} train and {truth['valid_documents']} valid documents to {_OUT_DIR.value} "
        f"in {time.perf_counter() - start:.1f}s: entropy rate {truth['entropy_rate_bits_per_char']:.4f} bits/char, "
        f"valid.txt {truth['valid_bits_per_byte']:.4f} bits/byte (truth.json)")


if __name__ == "__main__":
  cli.run(main, "proj.markov.make_text", user_errors=(ValueError,))
