"""Evaluation entry points (`python -m eval.<name>`): likelihood bounds, sample quality, Sudoku, ablations.

Planned in the eval issue; the training loop already reports the validation diffusion loss.
"""
