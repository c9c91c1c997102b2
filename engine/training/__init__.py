"""Draft-head training (``tandem train-draft``): self-distillation data, target features, the
Eagle3 and MTP heads trained through the inference modules, and their evaluation with the
engine. See ``trainer.train_draft`` and ``evaluate.evaluate_head``."""
