"""Training: metrics, run logs and pictures (the trainer loop joins them here).

Why the split: the trainer loop, checkpointing and configuration change with
the parallel plan; how a run is measured and recorded does not. Metrics
(:mod:`~hyfi_imaging.train.metrics`), the run log
(:mod:`~hyfi_imaging.train.logs`) and the pictures
(:mod:`~hyfi_imaging.train.plots`) are plain functions of gathered numbers,
usable on their own to evaluate a saved model or redraw an old run.
matplotlib and TensorBoard are imported on first use, so importing this
package stays cheap for ranks that never draw or log.
"""

from __future__ import annotations

from hyfi_imaging.train.logs import RunLogger, read_metrics_csv
from hyfi_imaging.train.metrics import EvalResult, Task, evaluate_predictions
from hyfi_imaging.train.plots import (
    plot_confusion_matrix,
    plot_resolution_comparison,
    plot_training_curves,
)

__all__ = [
    "EvalResult",
    "RunLogger",
    "Task",
    "evaluate_predictions",
    "plot_confusion_matrix",
    "plot_resolution_comparison",
    "plot_training_curves",
    "read_metrics_csv",
]
