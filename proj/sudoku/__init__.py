"""The Sudoku benchmark (docs/experiments/sudoku.md).

  data.py      the 'sudoku' data source: rows [BOS, 81 puzzle digits | 81 solution digits] (registers itself in
               dgemma.data.sources.SOURCES)
  eval.py      python -m proj.sudoku.eval: one-sample solve rates, generate-and-verify, probes
  make_csv.py  python -m proj.sudoku.make_csv: puzzle,solution CSVs
  configs/     sudoku.py (CPU recipe), sudoku_gpu.py (one GPU), sudoku_ar.py (AR baseline), renoise.py (ablation)
"""
