"""Head-only LoRA fine-tuning of a DiffusionGemma params checkpoint: the self-conditioning module trains
in full, plus rank-8 LoRA adapters that act only in decoder mode (finetune.mode='head_only'), so the
encoder and its KV cache stay exactly the base model's. Optimizer after the official Sudoku LoRA recipe
(clip 1.0, Adam(0.95, 0.99), weight decay 1e-4, warmup-cosine peak 1.5e-4, 2000 steps).

  # the base: a converted DiffusionGemma (python -m dgemma.tools.convert --from_hf DIR --to /ckpts/dgemma) or any
  # dgemma params checkpoint; the config argument after ':' is its directory (read into train.init_from).
  python train.py --config=configs/finetune_head_lora.py:/ckpts/dgemma --workdir=workdirs/head_lora \
      --config.data.source=files --config.data.files="('sft.jsonl',)" --config.finetune.lora_rank=4
  python sample.py --config=configs/finetune_head_lora.py:/ckpts/dgemma --workdir=workdirs/head_lora \
      --config.sample.prompt="Solve:"

Training writes the adapter-only checkpoint WORKDIR/adapter/ (self-conditioning + adapters) at the end.
The encoder is frozen and unadapted, so its next-token loss cannot change and is switched off
(diffusion.encoder_loss_weight = 0). Its adapters cannot be merged into the shared weights (that would
change the encoder); for mergeable adapters use --config.finetune.mode=lora.
"""

import json
import os

from configs import base


def get_config(checkpoint: str = ""):
  config = base.get_config()
  if checkpoint:
    with open(os.path.join(checkpoint, "model_config.json")) as f:
      config.model.update(json.load(f))
    config.model.preset = "imported"
    config.train.init_from = checkpoint
  config.data.tokenizer.kind = "file"
  config.data.tokenizer.path = os.path.join(checkpoint, "tokenizer.model") if checkpoint else ""
  config.data.seq_len = 512              # 256-token prompt + one 256-token canvas (Sudoku recipe)
  config.data.batch_size = 8
  config.diffusion.canvas_len = 256
  config.diffusion.encoder_loss_weight = 0.0
  config.finetune.mode = "head_only"
  config.finetune.lora_rank = 8
  config.finetune.lora_alpha = 16.0
  config.finetune.lora_targets = ("all",)
  config.finetune.freeze_router = True   # as NeMo: no router adapters
  config.model.remat = "full"
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"
  config.opt.lr = 1.5e-4
  config.opt.warmup_steps = 100
  config.opt.b1, config.opt.b2 = 0.95, 0.99
  config.opt.weight_decay = 1e-4
  config.opt.grad_clip = 1.0
  config.train.num_steps = 2000
  config.train.eval_every = 500
  config.train.ckpt_every = 500
  return config
