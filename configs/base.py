"""Every key the dgemma code reads, with its default. Experiment configs start from this.

Not meant to be run directly (its model is the full 26B trunk); see configs/demo.py and
configs/tiny_test.py. `dgemma.config.validate` rejects keys that are not defined here.
"""

import ml_collections

from configs.models import diffusiongemma_26b_a4b


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Architecture: a preset from configs/models/ (fields: dgemma.model.config.ModelConfig).
  config.model = diffusiongemma_26b_a4b.get_config()

  # Data: which text, how it is tokenized and packed (dgemma.data).
  config.data = ml_collections.ConfigDict()
  config.data.source = "shakespeare"     # 'shakespeare' | 'files' | 'tfds'
  config.data.files = ()                 # .txt / .jsonl paths when source == 'files'
  config.data.txt_mode = "line"          # .txt files: 'line' (one document per line) | 'file'
  config.data.jsonl_field = "text"       # .jsonl: the field that holds the document
  config.data.tfds_name = ""             # catalog name when source == 'tfds' (needs internet), e.g. 'lm1b'
  config.data.tfds_text_key = "text"
  config.data.cache_dir = "data_cache"   # built datasets, downloads, trained tokenizers
  config.data.validation_fraction = 0.05  # documents held out (deterministic by document hash)
  config.data.seq_len = 512              # packed sequence length = context + canvas
  config.data.batch_size = 8             # global batch
  config.data.shuffle = True
  config.data.num_epochs = 0             # 0 = repeat forever
  config.data.tokenizer = ml_collections.ConfigDict()
  config.data.tokenizer.kind = "sentencepiece"  # 'sentencepiece' (trained here) | 'byte' | 'file'
  config.data.tokenizer.vocab_size = 8192
  config.data.tokenizer.path = ""        # a SentencePiece .model file when kind == 'file'

  # Diffusion: uniform-state corruption and the training objective.
  config.diffusion = ml_collections.ConfigDict()
  config.diffusion.canvas_len = 256      # tokens denoised in parallel (the block length)
  config.diffusion.t_eps = 1e-4          # t ~ U(t_eps, 1)
  config.diffusion.encoder_loss_weight = 1.0  # next-token CE on the encoder's causal logits (0 = off)
  config.diffusion.self_cond_prob = 0.5  # two-pass self-conditioning training: P(second pass sees pass-1 logits)

  # Optimiser: AdamW, linear warmup then cosine decay, global-norm clipping.
  config.opt = ml_collections.ConfigDict()
  config.opt.lr = 3e-4
  config.opt.end_lr_fraction = 0.1
  config.opt.warmup_steps = 100
  config.opt.b1 = 0.9
  config.opt.b2 = 0.95
  config.opt.eps = 1e-8
  config.opt.weight_decay = 0.01
  config.opt.grad_clip = 1.0

  # Training loop.
  config.train = ml_collections.ConfigDict()
  config.train.num_steps = 1000
  config.train.log_every = 10
  config.train.eval_every = 200
  config.train.eval_batches = 4
  config.train.ckpt_every = 200
  config.train.keep_checkpoints = 3
  config.train.async_checkpointing = True
  config.train.progress_bar = True

  # Sampling (sample.py and the in-training preview); dgemma.sampling.SamplerConfig.from_config.
  # Released DiffusionGemma sampler defaults (HF transformers 5.24); canvas = diffusion.canvas_len.
  config.sample = ml_collections.ConfigDict()
  config.sample.prompt = ""
  config.sample.num_samples = 1
  config.sample.max_new_tokens = 256
  config.sample.max_denoising_steps = 48
  config.sample.entropy_bound = 0.1      # accept lowest-entropy tokens while cumsum(H) - H_i <= bound
  config.sample.t_max = 0.8              # temperature at the first step ...
  config.sample.t_min = 0.4              # ... falling linearly towards t_min
  config.sample.stability_threshold = 1  # stop: argmax canvas unchanged this many steps ...
  config.sample.confidence_threshold = 0.005  # ... and mean entropy below this (0 = never stop early)
  config.sample.end_ids = ()             # () = auto: EOS (1), plus <turn|> (106) for a tokenizer file
  config.sample.early_exit = True        # lax.while_loop exits when every row is done (else lax.scan)
  config.sample.self_conditioning = True  # False = zero self-conditioning signal at every step
  # Ablations (defaults = released sampler).
  config.sample.acceptance = "entropy_bound"  # 'entropy_bound' | 'confidence' | 'fixed_k'
  config.sample.accept_confidence = 0.9  # acceptance='confidence': top probability >= this
  config.sample.accept_k = 1             # acceptance='fixed_k': tokens accepted per step
  config.sample.renoise = "non_accepted"  # 'non_accepted' | 'none' | 'low_confidence'
  config.sample.renoise_confidence = 0.1  # renoise='low_confidence': re-noise if p(current) < this
  config.sample.top_k = 0                # logit shaping after the temperature (0 = off)
  config.sample.top_p = 1.0              # nucleus shaping (1.0 = off)
  config.sample.seed = 0
  config.sample.checkpoint_step = -1     # -1 = latest
  config.sample.trajectory_html = ""     # write one denoising trajectory as HTML here

  # Evaluation.
  config.eval = ml_collections.ConfigDict()
  config.eval.split = "validation"

  # Device mesh: axis sizes (-1 = all remaining devices) and logical-axis -> mesh-axis rules.
  config.mesh = ml_collections.ConfigDict()
  config.mesh.shape = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1))
  config.mesh.axis_rules = (
      ("batch", ("data", "fsdp")),
      ("vocab", "tensor"),
      ("embed", "fsdp"),
      ("heads", "tensor"),
      ("kv_heads", "tensor"),
      ("head_dim", None),
      ("mlp", "tensor"),
      ("expert", "expert"),
      ("expert_mlp", "tensor"),
      ("norm", None),
      ("layers", None),
  )
  return config
