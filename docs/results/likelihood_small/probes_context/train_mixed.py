"""train.py whose training loss is the mean of the configured canvas loss and the same loss with short canvases
(SHORT_C tokens each, as many as fill the configured canvases' tokens). MIX=both (default): both losses on the whole
batch (twice the decoder and encoder work per step); MIX=split: the short loss on the first half of the rows and the
configured one on the second (the plain step's work). A probe: the eval pass and every reported metric but
`short_canvas_ce` are the configured loss's (MIX=split: on its half)."""
import dataclasses, os, sys
sys.path.insert(0, os.getcwd())
import jax
from dgemma.diffusion import loss as loss_lib
SHORT_C = int(os.environ.get("SHORT_C", "2"))
MIX = os.environ.get("MIX", "both")
orig_loss = loss_lib.diffusion_loss


def diffusion_loss(params, batch, rng, *, loss_cfg, eval_metrics=False, **k):
  if eval_metrics:
    return orig_loss(params, batch, rng, loss_cfg=loss_cfg, eval_metrics=True, **k)
  short_cfg = dataclasses.replace(loss_cfg, canvas_len=SHORT_C,
                                  canvases_per_row=loss_cfg.canvas_len * loss_cfg.canvases_per_row // SHORT_C)
  k.pop("totals", None)  # each loss's own normalisers
  ids = k.pop("example_ids_B", None)
  half = batch["tokens"].shape[0] // 2
  short_rows, long_rows = (slice(0, half), slice(half, None)) if MIX == "split" else (slice(None), slice(None))
  part = lambda rows: ({key: v[rows] for key, v in batch.items()}, None if ids is None else ids[rows])
  long_batch, long_ids = part(long_rows)
  short_batch, short_ids = part(short_rows)
  loss, metrics = orig_loss(params, long_batch, rng, loss_cfg=loss_cfg, example_ids_B=long_ids, **k)
  short_loss, short_metrics = orig_loss(params, short_batch, jax.random.fold_in(rng, 1), loss_cfg=short_cfg,
                                        example_ids_B=short_ids, **k)
  metrics = dict(metrics, short_canvas_ce=short_metrics["canvas_ce"], loss=0.5 * (loss + short_loss))
  return 0.5 * (loss + short_loss), metrics


loss_lib.diffusion_loss = diffusion_loss
import runpy
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
