"""QLoRA of the diffusion head: configs/finetune_head_lora.py (head_only: the self-conditioning module in full plus
decoder-only rank-8 adapters, here on attention and the dense MLP) on a frozen base held quantized in the train
state (finetune.base_quant = 'int4_experts': the experts int4 in groups of 64, every other matrix int8 per
channel). The adapters and the self-conditioning module train in float32; the step runs in bfloat16 with full rematerialisation, one 512-token
row at a time (8 rows per update in 8 micro-batches): the released 26B-A4B's step is planned at 16.4 GiB on an
H100, 16.7 on a 24 GB sm_89 card (L4, RTX 4090) and 20.0 on a TPU v6e-1 (docs/finetuning.md).

  # the base, the config argument after ':': any checkpoint dgemma.load takes (a Hugging Face directory of the
  # released model, a params checkpoint, a run or an adapter); it is quantized tensor by tensor as it is read
  python train.py --config=configs/finetune_head_qlora.py:/ckpts/diffusiongemma-26b-a4b --workdir=workdirs/qlora \
      --config.data.source=files --config.data.files="('pairs.jsonl',)" --config.data.format=sft
  python sample.py --checkpoint=workdirs/qlora --prompts=prompts.txt   # on the same quantized base

  # without an argument: the released architecture, for the memory plan of its compiled train step (--target=h100
  # compiles it for an H100 without one, with the plugin make venv installs beside the environment)
  python -m dgemma.tools.memory --config=configs/finetune_head_qlora.py --train --target=h100
"""

from configs import finetune_head_lora
from configs.models import diffusiongemma_26b_a4b


def get_config(checkpoint: str = ""):
  config = finetune_head_lora.get_config(checkpoint)
  if not checkpoint:
    config.model = diffusiongemma_26b_a4b.get_config()
  config.finetune.base_quant = "int4_experts"
  config.finetune.base_quant_group_size = 64
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"   # the adapters and the self-conditioning module; the base is quantized
  config.model.remat = "full"
  # The compiled step's plan for an H100 (python -m dgemma.tools.memory ... --train --target=h100, one row of
  # 512 tokens): moe_impl 'ragged' 56.1 GiB (XLA lowers ragged_dot to [experts, rows, d_model] products), 'dense'
  # 44.0; adapters on attention and the dense MLP only (no per-expert pairs: 1.3 GiB of adapters and 2.6 of Adam
  # moments fewer) 36.8; then the experts packed, each layer rematerialised on its own and frozen products 16.4.
  # On a TPU the frozen base is also laid out as the step's compiler picks (dgemma.train.state.step_shardings).
  # docs/finetuning.md.
  config.model.moe_impl = "dense"
  config.finetune.lora_targets = ("attn", "mlp")
  config.data.batch_size = 8
  config.opt.grad_accum_steps = 8        # one row per micro-batch
  return config
