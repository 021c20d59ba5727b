"""The Hub: resolving model and dataset ids (lerobot checkpoints converted on load), checkpoint conversion, model
cards."""
