"""Reinforcement learning of the diffusion model on its own samples, through train.py (`config.rl`).

  config.py   RLSettings: the `rl` group (algorithm, reward, group size, log-likelihood, clipping, KL weight)
  reward.py   the reward registry (`rl.reward`): exact_match, a user's Python function, a study's rewards
  policy.py   the policy's log-likelihoods of its samples: the exact trajectory log-probability of the released
              sampler's accepted draws, or the completion's ELBO
  grpo.py     GRPO's arithmetic: group advantages, the clipped losses, the KL
and the loop's RL step (rollouts with the jitted sampler, rewards, updates) is dgemma/train/rl_step.py.

  python train.py --config=CONFIG --workdir=workdirs/rl   (CONFIG: an rl.algorithm='grpo' config; docs/rl.md)
"""
