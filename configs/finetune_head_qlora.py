"""QLoRA of the diffusion head: configs/finetune_head_lora.py (head_only: the self-conditioning module in full plus
decoder-only rank-8 adapters) on a frozen base held quantized in the train state (finetune.base_quant =
'int4_experts': the experts int4 in groups of 64, every other matrix int8 per channel). The adapters and the
self-conditioning module train in float32; the step runs in bfloat16 with full rematerialisation, one 512-token
row at a time (8 rows per update in 8 micro-batches), so the released 26B-A4B fine-tunes on one 24 GB card.

  # the base, the config argument after ':': any checkpoint dgemma.load takes (a Hugging Face directory of the
  # released model, a params checkpoint, a run or an adapter); it is quantized tensor by tensor as it is read
  python train.py --config=configs/finetune_head_qlora.py:/ckpts/diffusiongemma-26b-a4b --workdir=workdirs/qlora \
      --config.data.source=files --config.data.files="('pairs.jsonl',)" --config.data.format=sft
  python sample.py --checkpoint=workdirs/qlora --prompt="..."   # on the same quantized base

  # without an argument: the released architecture, for the memory plan of its compiled train step
  python -m dgemma.tools.memory --config=configs/finetune_head_qlora.py --train
"""

from configs import finetune_head_lora
from configs.models import diffusiongemma_26b_a4b


def get_config(checkpoint: str = ""):
  config = finetune_head_lora.get_config(checkpoint)
  if not checkpoint:
    config.model = diffusiongemma_26b_a4b.get_config()
  config.finetune.base_quant = "int4_experts"
  config.sample.quant_group_size = 64
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"   # the adapters and the self-conditioning module; the base is quantized
  config.model.remat = "full"
  config.data.batch_size = 8
  config.opt.grad_accum_steps = 8        # one row per micro-batch
  return config
