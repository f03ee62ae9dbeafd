"""The training loop, split by job (as nanodo splits it): `optimizer` (AdamW, schedule, frozen leaves), `state`
(the sharded TrainState of `state_types`, its initialisation and `train.init_from`), `step` (the jitted train
and eval steps, gradient accumulation, the non-finite guard), `metrics` (console, TensorBoard, metrics.jsonl),
`evaluate` (the validation pass) and `loop` (`train_and_evaluate`, what train.py calls: resume, checkpoints, the
loop itself). Meshes are dgemma.mesh, barriers dgemma.distributed, checkpoints dgemma.checkpoints.
"""
