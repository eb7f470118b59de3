"""Code shared by the four training scripts: data, model, metrics, checkpoints, plots and flags."""
