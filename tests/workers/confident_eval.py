"""Worker: a confident model's validation metrics are those of its logits.

Usage: ``python tests/workers/confident_eval.py MANIFEST OUT_DIR``. A ResNet-18 x0.125 on one
process whose classifier is scaled until the logit gaps reach tens (float32 probabilities
round to 1.0 there, float64 log-probabilities to 0.0 past 37), centred so that it is
confident both ways; prints one JSON line: the trainer's reported AUC and val_loss, and
both computed in float64 from the logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def main(manifest: str, out_dir: str) -> int:
    from hyfi_imaging.parallel.launch import shutdown
    from hyfi_imaging.train.config import load_recipe
    from hyfi_imaging.train.metrics import evaluate_predictions
    from hyfi_imaging.train.trainer import Trainer

    root = Path(__file__).resolve().parents[2]
    sets = [
        f"data.manifest={manifest}", f"train.out_dir={out_dir}", "model.kwargs.width=0.125",
        "parallel.spatial=1x1", "train.batch_size=2", "data.val_fraction=0.5",
    ]  # fmt: skip
    r = load_recipe(root / "recipes" / "synthetic.yaml", sets)
    t = Trainer(r)
    t.setup()
    t._plan_epochs()  # the split into training and validation images
    fc = dict(t.pm.module.named_modules())["fc"]

    def logits() -> torch.Tensor:
        outs = t._outputs(r.data.manifest, t.val_idx)
        return torch.cat([o[: len(rows)] for o, _, rows in outs]).double()

    with torch.no_grad():
        fc.weight.mul_(1000.0)  # logit gaps past 37: float64 log-probabilities round to 0
        fc.bias.zero_()
        gap = logits()
        fc.bias[1] = -float((gap[:, 1] - gap[:, 0]).median())
    z = logits()
    labels = np.array([t.val_samples[i].label for i in t.val_idx])
    got = t.evaluate()
    shutdown()
    print(
        json.dumps(
            {
                "gaps": (z[:, 1] - z[:, 0]).tolist(),
                "labels": labels.tolist(),
                "auc": got["auc"],
                "val_loss": got["val_loss"],
                # ranked by the margin itself (log-probabilities round to 0 past 37)
                "auc_logits": evaluate_predictions(
                    torch.stack([torch.zeros_like(z[:, 0]), z[:, 1] - z[:, 0]], 1).numpy(),
                    labels,
                    task="binary",
                ).auc,
                "loss_logits": float(F.cross_entropy(z, torch.from_numpy(labels))),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
