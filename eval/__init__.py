"""Evaluation entry points (`python -m eval.<name>`), each reading any checkpoint kind dgemma.load takes (a training
run, a params checkpoint, an adapter, a Hugging Face directory; dgemma/checkpoints/) and the `eval.*` settings
(`python -m dgemma.settings eval` lists them; flags of the same name override):

  eval.likelihood        block-autoregressive NELBO bound (exact NLL for AR runs): nats/token, bits/byte,
                         perplexity, and the uniform baseline; --reference for a paired ratio
  eval.likelihood_curve  the bound of a run's checkpoints against training minutes, several runs on one plot
  eval.validation_curve  a run's validation metrics against steps, and the step each first reaches a threshold
  eval.samples           generate N samples; generative perplexity under an AR reference, entropy, distinct-n,
                         real-word rate, speed
  eval.ablate            sweep named settings (configs/ablations/*.py) through a metric; CSV + PNG plots
  cli_flags              what the command lines share: the flags named after eval.* keys
The studies' evaluations live with them: python -m proj.sudoku.eval, proj.markov.oracle / .denoisers / .profile.
"""
