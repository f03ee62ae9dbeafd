"""What a resumed run may and may not change, on typed settings (dgemma/train/loop.py `check_resume`).

  architecture_differences(saved, new)  keys whose change makes `new` unable to read `saved`'s checkpoints
  training_differences(saved, new)      the other keys that change what a run trains (allowed with steps left,
                                        recorded in WORKDIR/config_changes.jsonl)
Each entry reads 'key: saved -> new'.
"""

from __future__ import annotations

from dgemma import settings_fields

# ModelConfig fields that may differ between a checkpoint and the run that reads it (compute choices, not
# the shapes of the parameters).
# Of those, how the forward pass is computed (the same function, other kernels or memory): a checkpoint that carries
# no run's settings (HF, params) takes them from the caller's config.
COMPUTE_MODEL_FIELDS = ("moe_impl", "moe_dense_block", "moe_capacity_factor", "attention_impl", "remat")
RUNTIME_MODEL_FIELDS = ("preset", "dtype", "param_dtype", *COMPUTE_MODEL_FIELDS, "router_aux_loss_weight",
                        "router_z_loss_weight")

# Keys besides the architecture whose change alters which parameters and optimizer states exist, or what the
# token ids mean.
STRUCTURAL_KEYS = ("distill.method", "rl.algorithm", "finetune.mode", "finetune.lora_rank", "finetune.lora_targets",
                   "finetune.freeze_router", "finetune.base_quant_scale_dtype", "opt.optimizer", "opt.state_dtype", "data.tokenizer.kind",
                   "data.tokenizer.vocab_size", "data.tokenizer.path")

# The groups whose keys change what a run trains. Changing one on resume is allowed (a researcher extends
# train.num_steps or lowers opt.lr), but it is listed. Everything else is bookkeeping or inference
# (train.log_every, sample.*, eval.*, mesh.*: where the run writes, samples or lays out its arrays).
TRAINING_GROUPS = ("seed", "data", "diffusion", "distill", "opt", "train", "finetune", "rl")
TRAINING_MODEL_FIELDS = ("dtype", "param_dtype", "router_aux_loss_weight", "router_z_loss_weight")
NON_TRAINING_KEYS = frozenset((
    "data.cache_dir", "finetune.save_adapter", "opt.grad_accum_steps",  # the same update (optimizer docstring)
    "train.log_every", "train.eval_every", "train.eval_batches", "train.ckpt_every", "train.keep_checkpoints",
    "train.async_checkpointing", "train.progress_bar", "train.init_from",  # read only by a fresh run
    "train.nonfinite", "train.max_nonfinite_skips", "train.restore_step", "train.on_corrupt_checkpoint"))


def _diff(a: dict, b: dict, names) -> list[str]:
  return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in names if a.get(k) != b.get(k)]


def model_differences(saved, new) -> list[str]:
  """'model.key: saved -> new' for every architecture field (not a compute choice) of two ModelConfigs that
  differs: weights saved with `saved` cannot be read as `new`."""
  a, b = settings_fields.flat(saved, "model"), settings_fields.flat(new, "model")
  return _diff(a, b, [k for k in sorted(a) if k.split(".", 1)[1] not in RUNTIME_MODEL_FIELDS])


def architecture_differences(saved, new) -> list[str]:
  """The keys whose change makes Settings `new` unable to resume a run saved with `saved`: the model architecture
  (not its compute choices), the fine-tuning layout (which parameters and optimizer states exist), the optimizer
  (its state's layout) and its state dtype, and the tokenizer."""
  return model_differences(saved.model, new.model) + _diff(settings_fields.flat(saved), settings_fields.flat(new),
                                                           STRUCTURAL_KEYS)


def training_differences(saved, new) -> list[str]:
  """'key: saved -> new' for every key that changes what a run trains (TRAINING_GROUPS, the model's
  TRAINING_MODEL_FIELDS), other than the architecture keys of `architecture_differences`."""
  structural = {d.split(":")[0] for d in architecture_differences(saved, new)}
  a, b = settings_fields.flat(saved), settings_fields.flat(new)
  keys = [k for k in sorted(set(a) | set(b))
          if (k.split(".")[0] in TRAINING_GROUPS or k in {f"model.{f}" for f in TRAINING_MODEL_FIELDS})
          and k not in NON_TRAINING_KEYS and k not in structural]
  return _diff(a, b, keys)
