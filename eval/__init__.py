"""Evaluation entry points (`python -m eval.<name>`), all reading a training workdir or a params checkpoint
(eval/checkpoints.py) and the `eval.*` settings of configs/base.py:

  eval.likelihood  block-autoregressive NELBO bound (exact NLL for AR runs): nats/token, bits/byte, perplexity
  eval.samples     generate N samples; generative perplexity under an AR reference, entropy, distinct-n, speed
  eval.ablate      sweep named settings (configs/ablations/*.py) through a metric; CSV + PNG plots
"""
