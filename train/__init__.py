"""Entry points (`python -m train.train`, `python -m train.prepare_data`, `python -m train.aot`), YAML presets
under train/configs/, and launch scripts for a TPU pod, SLURM and a local multi-process run."""
