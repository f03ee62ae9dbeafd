"""Studies built on the dgemma library, one folder each (as big_vision keeps projects): their data, evaluation,
tools and configs together, so dgemma/ reads as the DiffusionGemma library.

  proj/sudoku/   the Sudoku benchmark: a data source ('sudoku'), the one-sample solver and its probes, the CSV
                 tool, configs (docs/experiments/sudoku.md)
  proj/markov/   the Markov-source likelihood study: a source whose entropy rate is known exactly, the exact
                 denoisers and oracle sampler, the profile tool, the recipe config (docs/experiments/likelihood_small.md)
"""
