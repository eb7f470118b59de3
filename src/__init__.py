"""The training library: what the five train_*.py scripts share (data, model, recipe, checkpoints,
progress, the processes). The commands around training are in src/tools/."""
