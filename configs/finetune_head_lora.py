"""Head-only LoRA fine-tuning of a DiffusionGemma checkpoint: the self-conditioning module trains in full, plus
rank-8 LoRA adapters that act only in decoder mode (finetune.mode='head_only'), so the encoder and its KV cache
stay exactly the base model's. Optimizer after the official Sudoku LoRA recipe (clip 1.0, Adam(0.95, 0.99), weight
decay 1e-4, warmup-cosine peak 1.5e-4, 2000 steps). Data: prompt/response pairs or chats with data.format=sft
(dgemma/data/sft.py), or plain text.

  # the base, the config argument after ':': any checkpoint dgemma.load takes (a training run such as
  # workdirs/demo, a params checkpoint, an adapter or a Hugging Face directory; configs/models/from_checkpoint.py)
  python train.py --config=configs/finetune_head_lora.py:/ckpts/dgemma --workdir=workdirs/head_lora \
      --config.data.source=files --config.data.files="('sft.jsonl',)" --config.data.format=sft \
      --config.finetune.lora_rank=4
  python sample.py --checkpoint=workdirs/head_lora --prompts=prompts.jsonl   # {"prompt": ...} per line

The model group, tokenizer and (for a run) canvas and sequence length come from the checkpoint. Training writes
the adapter-only checkpoint WORKDIR/adapter/ (self-conditioning + adapters) at the end. The encoder is frozen and
unadapted, so its next-token loss cannot change and is switched off (diffusion.encoder_loss_weight = 0). Its
adapters cannot be merged into the shared weights (that would change the encoder); for mergeable adapters use
--config.finetune.mode=lora.
"""

from configs import base
from configs.models import from_checkpoint


def get_config(checkpoint: str = ""):
  config = base.get_config()
  config.data.tokenizer.kind = "file"  # the checkpoint's (from_checkpoint.apply, below)
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
  return from_checkpoint.apply(config, checkpoint) if checkpoint else config
