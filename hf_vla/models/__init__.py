"""The model families, each a transformers model folder (`pi05`, `value`), and what they share (`common`).
`hf_vla.models.auto` registers them with the Auto classes (as `import hf_vla` does); this package itself imports
nothing heavy, so the commands' settings (`common/rtc_config.py`) load without torch."""
