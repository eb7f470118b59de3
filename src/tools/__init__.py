"""The commands around training: data preparation, prediction, benchmarks and comparisons.

Run each as `python -m src.tools.NAME --help`. They import the training library (src/); the
training scripts never import them.
"""
