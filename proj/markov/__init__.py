"""The Markov-source likelihood study (docs/experiments/likelihood_small.md, markov_oracle.md).

  data.py       an order-k Markov chain over bytes whose entropy rate is known exactly, its exact scores
  make_text.py  python -m proj.markov.make_text: train / valid text files and truth.json
  denoisers.py  python -m proj.markov.denoisers: exact denoisers of the source, the bound they give
  oracle.py     python -m proj.markov.oracle: the sampler driven by the source's exact marginals
  profile.py    python -m proj.markov.profile: where along t a model's bound is lost
  configs/      likelihood_small.py, the recipe
"""
