"""Every key the dgemma code reads, with its default. Experiment configs start from this.

Not meant to be run directly (its model is the full 26B trunk); see configs/demo.py and
configs/tiny_test.py. `dgemma.settings.from_config` rejects keys that are not defined here.
"""

import ml_collections

from configs.mesh import cpu_host
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
  config.data.encoding_errors = "strict"  # invalid UTF-8 in data files: 'strict' (an error naming the file and
                                         # line) | 'replace' (U+FFFD for each bad byte)
  config.data.tokenizer = ml_collections.ConfigDict()
  config.data.tokenizer.kind = "sentencepiece"  # 'sentencepiece' (trained here) | 'byte' | 'file'
  config.data.tokenizer.vocab_size = 8192
  config.data.tokenizer.path = ""        # a SentencePiece .model file when kind == 'file'
  # Sudoku (data.source == 'sudoku', dgemma/data/sudoku.py): fixed rows [BOS, 81 puzzle digits | 81 solution
  # digits] (needs tokenizer.kind='byte', seq_len=163, diffusion.canvas_len=81); eval: python -m eval.sudoku.
  config.data.sudoku = ml_collections.ConfigDict()
  config.data.sudoku.train_csv = ""      # puzzle,solution CSV (python -m dgemma.tools.sudoku_csv); "" = generate
  config.data.sudoku.validation_csv = ""  # the same for the validation split; "" = generate
  config.data.sudoku.num_train = 2000    # puzzles generated (unique solutions) when train_csv is empty ...
  config.data.sudoku.num_validation = 200  # ... / validation_csv is empty; cached under data.cache_dir/sudoku
  config.data.sudoku.min_blanks = 30     # blanks per generated puzzle ~ U{min_blanks..max_blanks}
  config.data.sudoku.max_blanks = 45
  config.data.sudoku.augment = True      # train rows: a random validity-preserving symmetry per row (seeded)
  config.data.sudoku.infill_givens = False  # the givens' canvas cells stay clean in training (unscored) and
                                         # are held by the sampler's infilling in eval (diffusion runs only)

  # Diffusion: uniform-state corruption and the training objective.
  config.diffusion = ml_collections.ConfigDict()
  config.diffusion.canvas_len = 256      # tokens denoised in parallel (the block length)
  config.diffusion.t_eps = 1e-4          # t ~ U(t_eps, 1)
  config.diffusion.encoder_loss_weight = 1.0  # next-token CE on the encoder's causal logits (0 = off)
  config.diffusion.self_cond_prob = 0.5  # two-pass self-conditioning training: P(second pass sees pass-1 logits)
  # Canvas objective (dgemma/diffusion/objectives.py): 'base_ce' (released: plain CE at every canvas position) |
  # 'reweighted_ce' (CE * min(-alpha'/alpha, reweight_cap) = 1/(1-t) for the linear schedule) |
  # 'loo_ce' / 'reweighted_loo_ce' (CE under softmax(f + log(1 + V alpha/(1-alpha)) onehot(x_t))) |
  # 'loo_replaced_ce' (plain CE of f only where the forward process drew a token) | 'loo_ce_replaced_ce' (sum) |
  # 'nelbo' (continuous-time uniform-state NELBO) | 'loo_nelbo' | 'loo_nelbo_ce' |
  # 'mdlm' (masked-diffusion baseline, tokens -> mask_id) |
  # 'ar' (baseline: causal next-token CE over the whole row, no canvas).
  config.diffusion.objective = "base_ce"
  config.diffusion.schedule = "linear"   # alpha(t) (dgemma/diffusion/schedules.py): 'linear' 1 - t (released) |
                                         # 'cosine' cos(pi t / 2) | 'loglinear' 1 - (1 - schedule_eps) t
  config.diffusion.schedule_eps = 1e-3   # 'loglinear': alpha(1) = schedule_eps
  config.diffusion.reweight_cap = 10.0   # reweighted_*: cap on the time weight (reached at t = 1 - 1/cap)
  config.diffusion.mask_id = 4           # objective='mdlm': the mask token (Gemma MASK = 4); must be unused
  config.diffusion.antithetic_t = False  # t_b = eps + (1-eps) frac(u + b/B): low-variance t (NELBO eval)
  config.diffusion.t_power = 1.0         # training times t = eps + (1 - eps) u^t_power (1 = uniform; 2, 3: more
                                         # low-noise examples, density ~ t^(1/p - 1); the eval bound still
                                         # integrates t uniformly, the train-time canvas_nelbo metric is
                                         # importance-weighted back to it, validation draws uniform t)
  config.diffusion.t_mixture = ()        # (weight, t_lo, t_hi): each example's t is instead U(t_lo, t_hi) with
                                         # probability weight (0 < weight < 1); the train-time canvas_nelbo is
                                         # importance-weighted back to uniform t, validation draws uniform t
                                         # (dgemma/train/step.py). () = off
  # Duo's curriculum (dgemma/diffusion/relaxation.py): for the first curriculum_steps training steps the
  # decoder reads softmax(w / tau) of a Gaussian latent w whose argmax is the uniform-state canvas (same
  # alpha(t), same loss at the argmax); tau goes geometrically from tau_start to tau_end. 0 = off.
  config.diffusion.curriculum_steps = 0
  config.diffusion.curriculum_tau_start = 1e-3
  config.diffusion.curriculum_tau_end = 1e-3
  config.diffusion.curriculum_alpha_range = ()  # (alpha_lo, alpha_hi): the curriculum's times as Duo draws them,
                                         # log-SNR uniform between those levels (Duo on GPT-2: about (0.04, 0.93));
                                         # () = the schedule's alpha(t)

  # Discrete consistency distillation (Duo; dgemma/diffusion/distill.py): train a few-step student from the
  # trained run in train.init_from (configs/distill_dcd.py). Each round of round_steps steps freezes a copy of
  # the student as the teacher and trains the student to match, from z_t, the teacher's prediction at
  # s = t - dt on the same Gaussian trajectory; dt doubles per round from 1/teacher_steps to 1/student_steps.
  config.distill = ml_collections.ConfigDict()
  config.distill.method = "none"         # 'none' | 'dcd'
  config.distill.teacher_steps = 64      # round 0's dt = 1 / teacher_steps
  config.distill.student_steps = 4       # the last rounds' dt = 1 / student_steps (teacher_steps / student_steps
                                         # must be a power of 2: log2 of it + 1 rounds)
  config.distill.round_steps = 100       # training steps per round (the teacher is refreshed at each start)
  config.distill.divergence = "kl_fwd"   # 'kl_fwd' KL(teacher || student) | 'kl_bwd' KL(student || teacher)

  # SFT data and block-causal multi-canvas training (dgemma/data/sft.py; dgemma/diffusion/loss.py docstring).
  config.data.format = "text"            # 'text' (packed documents) | 'sft' (.jsonl prompt/response or chat)
  config.data.prompt_field = "prompt"    # format='sft': .jsonl field of the prompt ...
  config.data.response_field = "response"  # ... and of the response
  config.data.messages_field = "messages"  # ... or a chat: [{role, content}, ...], the last turn the response
  config.data.sft_overflow = "truncate_left"  # prompt + earlier canvases > seq_len - canvas_len: drop the
                                         # oldest context tokens ('truncate_left') or raise ('error')
  config.diffusion.canvases_per_row = 1  # K: the row's last K * canvas_len tokens are K canvases denoised in
                                         # one block-causal decoder pass (1 = a single canvas)
  # Short canvases (training only; dgemma/diffusion/loss.py docstring): a second decoder pass on the same encoder
  # cache denoises the row's last A * short_canvas_len tokens as A short canvases; the loss is
  # (1 - short_canvas_weight) * the configured canvases' loss + short_canvas_weight * theirs. Teaches the decoder
  # to read its clean context early (docs/results.md, "A diffusion likelihood against the truth").
  config.diffusion.short_canvas_len = 0  # S (0 = off), e.g. 2
  config.diffusion.short_canvases_per_row = 0  # A (0 = as many as the K canvases' tokens cover)
  config.diffusion.short_canvas_weight = 0.5

  # Optimiser: global-norm clipping, then AdamW or Muon (dgemma/train/optimizer.py OPTIMIZERS); linear warmup then
  # cosine decay of every learning rate.
  config.opt = ml_collections.ConfigDict()
  config.opt.optimizer = "adamw"         # 'adamw' | 'muon' (hidden matrices: orthogonalised momentum at muon_lr;
                                         # the rest: Nesterov AdamW at lr, no weight decay; full training only)
  config.opt.muon_lr = 0.02              # 'muon': the matrices' peak learning rate (opt.lr: the other parameters')
  config.opt.muon_momentum = 0.95        # 'muon': the matrices' (Nesterov) momentum
  config.opt.lr = 3e-4
  config.opt.end_lr_fraction = 0.1
  config.opt.warmup_steps = 100
  config.opt.b1 = 0.9
  config.opt.b2 = 0.95
  config.opt.eps = 1e-8
  config.opt.weight_decay = 0.01
  config.opt.grad_clip = 1.0
  config.opt.grad_accum_steps = 1        # micro-batches per step (scan; same update as the whole batch)
  config.opt.state_dtype = "float32"     # Adam mu/nu storage: 'float32' | 'bfloat16'

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
  config.train.init_from = ""            # params checkpoint (python -m dgemma.tools.convert --to ...) or training
                                         # workdir (its latest step) to start from; params only
  config.train.nonfinite = "halt"        # a non-finite loss, gradient norm or state: 'halt' (error naming the step;
                                         # nothing non-finite is saved) | 'skip' (drop that update, count it in
                                         # the metrics as nonfinite_skips, halt after max_nonfinite_skips in a row)
  config.train.max_nonfinite_skips = 10
  config.train.restore_step = -1         # resume from this step of the workdir's checkpoints (-1 = the latest)
  config.train.on_corrupt_checkpoint = "fallback"  # a checkpoint that cannot be read on resume: 'fallback'
                                         # (move it aside to WORKDIR/corrupt/, warn, restore the previous
                                         # complete step) | 'error'

  # Fine-tuning (dgemma/finetune.py, dgemma/model/lora.py): which parameters train, LoRA adapters.
  config.finetune = ml_collections.ConfigDict()
  config.finetune.mode = "full"          # 'full' (every parameter) | 'lora' (only LoRA adapters on the
                                         # lora_targets; W + (alpha/rank) A B with B = 0 at the start) |
                                         # 'head_only' (the self-conditioning module in full plus adapters
                                         # that act only in decoder mode: encoder and KV cache stay the base's)
  config.finetune.lora_rank = 8          # r of every adapter (lora / head_only)
  config.finetune.lora_alpha = 16.0      # adapter scale = lora_alpha / lora_rank
  config.finetune.lora_targets = ("all",)  # adapted module kinds: 'all' or a subset of 'attn' (q/k/v/o),
                                         # 'mlp' (dense GeGLU), 'experts' (one pair per expert), 'router',
                                         # 'self_conditioning' (lora mode only; head_only trains it in full)
  config.finetune.freeze_router = False  # router weights stay fixed (full mode: frozen; lora / head_only:
                                         # no router adapters). NeMo keeps the router frozen.
  config.finetune.save_adapter = True    # lora / head_only: at the end of training also write
                                         # WORKDIR/adapter/, a params checkpoint of only the trained leaves
                                         # (merge: python -m dgemma.tools.merge_lora); no effect in full mode

  # Sampling (sample.py and the in-training preview); dgemma.sampling.SamplerConfig.from_config.
  # Released DiffusionGemma sampler defaults (HF transformers 5.24); canvas = diffusion.canvas_len.
  # Every value is checked before anything is loaded or compiled (errors name the key).
  config.sample = ml_collections.ConfigDict()
  config.sample.prompt = ""              # text after BOS; with max_new_tokens it must fit max_context
  config.sample.num_samples = 1          # rows generated from the prompt (> 0)
  config.sample.max_new_tokens = 256     # response length cap (> 0), generated canvas by canvas
  config.sample.max_context = 0          # positions the model may use: prompt + ceil(max_new_tokens /
                                         # canvas_len) * canvas_len <= this; 0 = 262,144 (DiffusionGemma)
  config.sample.max_denoising_steps = 48  # decoder passes per canvas at most (> 0)
  config.sample.entropy_bound = 0.1      # (> 0) accept lowest-entropy tokens while cumsum(H) - H_i <= bound
  config.sample.t_max = 0.8              # temperature at the first step ...
  config.sample.t_min = 0.4              # ... falling linearly towards t_min
  config.sample.stability_threshold = 1  # stop: argmax canvas unchanged this many steps ...
  config.sample.confidence_threshold = 0.005  # ... and mean entropy below this (0 = never stop early)
  config.sample.end_ids = ()             # () = auto: EOS (1), plus <turn|> (106) for a tokenizer file
  config.sample.early_exit = True        # lax.while_loop exits when every row is done (else lax.scan)
  config.sample.self_conditioning = True  # False = zero self-conditioning signal at every step
  # Ablations (defaults = released sampler).
  config.sample.sampler = "released"     # 'released' | 'ancestral' (uniform-state posterior q(z_s|z_t, x_theta)
                                         # from t=1 to 0 over max_denoising_steps; no acceptance/early stop;
                                         # loo-trained models get their loo x0 logits) | 'pc' (predictor-
                                         # corrector: each ancestral pass followed by pc_corrector_steps
                                         # passes re-drawing z ~ alpha x_theta + (1 - alpha)/N at its level,
                                         # the same max_denoising_steps passes in all) | 'masked' (MDLM reveal
                                         # sampling from all-mask; the only sampler for objective='mdlm')
  config.sample.pc_corrector_steps = 1   # sampler='pc': correctors per predictor (steps % (1 + this) == 0)
  config.sample.pc_corrector_fraction = 1.0  # sampler='pc': share of positions a corrector re-draws (1: all)
  config.sample.acceptance = "entropy_bound"  # 'entropy_bound' | 'confidence' | 'fixed_k'
  config.sample.accept_confidence = 0.9  # acceptance='confidence': top probability >= this
  config.sample.accept_k = 1             # acceptance='fixed_k': tokens accepted per step
  config.sample.renoise = "non_accepted"  # 'non_accepted' (released: all non-accepted get fresh tokens)
                                         # | 'none' (non-accepted keep their token) | 'low_confidence'
                                         # (accepted tokens stay until p(token) < renoise_confidence)
  config.sample.renoise_confidence = 0.1  # renoise='low_confidence': re-noise a held token below this
  config.sample.top_k = 0                # logit shaping after the temperature (0 = off)
  config.sample.top_p = 1.0              # nucleus shaping (1.0 = off)
  config.sample.alpha_schedule = "linear"  # sampler='ancestral' / 'pc' / 'masked': a schedule of dgemma/diffusion/
                                         # schedules.py ('linear' alpha = 1 - t | 'cosine' | 'loglinear' (MDLM/
                                         # UDLM) alpha = exp(-sigma), sigma = -log(1 - (1 - eps) t))
  config.sample.schedule_eps = 1e-3      # eps of the 'loglinear' schedule (alpha(1) = eps)
  config.sample.greedy_last_step = True  # 'ancestral' / 'pc': last step takes argmax(x_theta)
  config.sample.infill = ()              # ((response position, token id), ...) held fixed in every row
  config.sample.seed = 0
  config.sample.checkpoint_step = -1     # -1 = latest
  config.sample.trajectory_html = ""     # write one denoising trajectory as HTML here
  config.sample.show = "none"            # 'none' | 'live': redraw the canvases in the terminal every step
  config.sample.semantics = "hf"         # whose released sampler: 'hf' (transformers 5.24, the tested default) |
                                         # 'official' (google-deepmind/gemma's JAX sampler: per-query sliding
                                         # window, commits the last sampled canvas, bf16 self-conditioning
                                         # embedding, its stopping rule; docs/model.md "Two references")
  # Weight-only quantization applied at load (dgemma/quant.py, quant.quantize_params): 'none' | 'int8'
  # (one scale per output channel) | 'int4' (one scale per quant_group_size inputs; 0 = per channel).
  config.sample.quantize = "none"
  config.sample.quant_group_size = 64    # int4 group along the contracted axis; must divide it
  config.sample.quantize_embedding = True  # also the tied embedding / output table (per-row scales)

  # Evaluation.
  config.eval = ml_collections.ConfigDict()
  config.eval.split = "validation"
  # ---- eval/ (python -m eval.likelihood / eval.samples / eval.ablate); flags of the same name override ----
  config.eval.data = ""                  # likelihood: a .txt/.jsonl file (data.txt_mode / data.jsonl_field) or
                                         # a split name of the run's dataset; '' = eval.split
  config.eval.max_documents = 0          # likelihood: first this many documents (0 = all)
  config.eval.max_tokens = 0             # likelihood: score at most this many tokens of each document, cut at
                                         # whitespace (a cut document gets no EOS); 0 = whole documents
  config.eval.context_len = 0            # likelihood: clean tokens each canvas conditions on (0 = data.seq_len
                                         # - diffusion.canvas_len, the training context)
  config.eval.num_t_samples = 8          # likelihood: antithetic Monte-Carlo t samples per canvas
  config.eval.self_conditioning = True   # likelihood: x_theta from the two-pass self-conditioned decoder
                                         # (training's second pass); False = one pass, zero signal
  config.eval.batch_size = 32            # likelihood: canvases per forward pass
  config.eval.num_samples = 16           # samples: how many samples (rows of one generate call)
  config.eval.prompts = ""               # samples: prompts file (.txt lines / .jsonl 'prompt' field), used
                                         # cyclically; '' = sample.prompt for every row
  config.eval.reference = ""             # samples: AR checkpoint (diffusion.objective='ar', same tokenizer)
                                         # for generative perplexity; '' = not reported. likelihood: any
                                         # checkpoint (same tokenizer, canvas_len) scored on the same canvases
                                         # for a paired ratio
  config.eval.ar_temperature = 1.0       # samples from an AR checkpoint: 0 = greedy
  config.eval.real_words = ""            # samples: real_word_rate against the words (lowercased letter runs)
                                         # of 'train' (the run's training split; data.source 'shakespeare' /
                                         # 'files') or of a .txt file ('' = not reported)
  config.eval.truth = ""                 # samples: a Markov source's truth.json (python -m dgemma.tools.markov_text):
                                         # the samples' exact bits per byte under the source ('' = not reported)
  config.eval.samples_out = ""           # samples: write every sample as JSONL here ('' = do not)
  config.eval.out = ""                   # likelihood / samples: write the summary JSON here ('' = print only)
  config.eval.seed = 0                   # noise for the likelihood's t and z_t draws, and for training's
                                         # validation pass (not `seed`: every run is scored on the same draws)

  # Device mesh (dgemma.mesh.make_mesh): a preset from configs/mesh/ (cpu_host | gpu8_expert |
  # tpu_slice) with keys `preset` (informational), `shape` (axis sizes of data, fsdp, expert, tensor;
  # -1 = all remaining devices) and `axis_rules` (logical axis -> mesh axes, params and activations).
  config.mesh = cpu_host.get_config()
  return config
