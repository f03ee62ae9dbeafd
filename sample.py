"""Samples from any checkpoint with the DiffusionGemma sampler (or the AR decoder for an AR model).

  python sample.py --checkpoint=workdirs/demo                        # a training run (also: --workdir=...)
  python sample.py --checkpoint=/ckpts/dgemma --prompts=prompts.txt --out=samples.jsonl   # converted weights
  python sample.py --checkpoint=/hf/diffusiongemma-26B-A4B-it --chat --prompts=chats.jsonl  # an HF directory
  python sample.py --config=configs/demo.py --checkpoint=workdirs/demo --config.sample.prompt="ROMEO:" \\
      --config.sample.num_samples=4 --steps=32 --seed=1 --temperature=0.6

  # watch the canvases being denoised (ANSI redraw per step; accepted tokens bold green):
  python sample.py --config=configs/demo.py --checkpoint=workdirs/demo --config.sample.show=live
  # ablation: uniform-state ancestral sampling from the posterior (configs/base.py, `sample` block)
  python sample.py --config=configs/demo.py --checkpoint=workdirs/demo --config.sample.sampler=ancestral \\
      --config.sample.alpha_schedule=loglinear

--checkpoint is a training workdir, a params checkpoint (python -m dgemma.tools.convert), an adapter or a
Hugging Face directory (dgemma/checkpoints/). A run's architecture and tokenizer come from the run itself;
--config (optional) supplies the `sample`, `eval` and `mesh` settings (and, for checkpoints that carry no
run config, the rest). --prompts: a .txt file (one prompt a line) or .jsonl (`prompt` or `messages`);
default sample.prompt, sample.num_samples times. --chat renders prompts as chat turns (Gemma 4 turn format).
--out writes one JSON record per prompt (prompt, text, decoder_passes, tokens_per_pass, seconds_per_prompt: the
call's time over its prompts, which run together); --text_out the printed samples. --step samples a run's earlier
checkpoint. --steps / --seed / --temperature are shorthands for sample.max_denoising_steps, sample.seed and a
constant temperature (sample.t_max = sample.t_min). Bad settings and unwritable outputs fail before the
checkpoint is read.
"""

from absl import app, flags
from ml_collections import config_flags

from dgemma import api
from dgemma.tools import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config whose `sample` (and `mesh`) group to use (optional).",
                                          lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A training workdir, params checkpoint, adapter or HF directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (the same as --checkpoint).")
_PROMPTS = flags.DEFINE_string("prompts", None, "Prompts file: .txt (one per line) or .jsonl ('prompt' / 'messages').")
_OUT = flags.DEFINE_string("out", None, "Write one JSON record per prompt here (.jsonl).")
_TEXT_OUT = flags.DEFINE_string("text_out", None, "Also write the printed samples to this text file.")
_STEP = flags.DEFINE_integer("step", None, "A training run's checkpoint step to sample (sample.checkpoint_step; "
                             "default the latest).")
_CHAT = flags.DEFINE_bool("chat", False, "Render prompts as chat turns (instruction-tuned checkpoints).")
_STEPS = flags.DEFINE_integer("steps", None, "Max denoising steps per canvas (sample.max_denoising_steps).")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed (sample.seed).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Constant sampling temperature (sample.t_max = sample.t_min).")


def main(argv):
  cli.no_extra_args(argv)
  if bool(_CHECKPOINT.value) == bool(_WORKDIR.value):
    raise app.UsageError("pass one of --checkpoint or --workdir")
  api.sample_command(_CHECKPOINT.value or _WORKDIR.value, cli.config(_CONFIG), prompts_file=_PROMPTS.value,
                     out=_OUT.value, text_out=_TEXT_OUT.value, chat=_CHAT.value, steps=_STEPS.value,
                     seed=_SEED.value, temperature=_TEMPERATURE.value, step=_STEP.value)


if __name__ == "__main__":
  cli.run(main, "sample.py", user_errors=(ValueError,))
