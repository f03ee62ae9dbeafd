"""Shared fixtures: a tiny text corpus and the tiny_test config pointed at it."""

import os
import random

import pytest

# Keep tests on CPU, deterministic, and quiet.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

_WORDS = ("the king queen crown sword night day love death fair foul heart blood tears sweet "
          "lord lady speak hence thou thee thy art doth hath noble gentle wretched bright").split()


def write_corpus(path, num_docs=60, seed=0):
  """A deterministic toy corpus, one document per line."""
  rnd = random.Random(seed)
  lines = []
  for _ in range(num_docs):
    lines.append(" ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(8, 60))) + ".")
  path.write_text("\n".join(lines) + "\n")
  return path


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("corpus") / "toy.txt")


@pytest.fixture
def tiny_config(corpus_file, tmp_path_factory):
  from configs import tiny_test
  config = tiny_test.get_config()
  config.data.source = "files"
  config.data.files = (str(corpus_file),)
  config.data.cache_dir = str(tmp_path_factory.getbasetemp() / "data_cache")
  config.train.async_checkpointing = False
  return config
