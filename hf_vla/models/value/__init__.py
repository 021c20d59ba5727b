"""RECAP's value model: pi0.5's backbone and a distribution over the normalised return (`returns.py`: the arithmetic
of rewards, returns, bins and advantages, importable without torch), and best-of-N's chunk critic, the same model
reading an action chunk too. Names load on first use."""

from hf_vla.cli import lazy_attributes

_PUBLIC = {"PI05ValueConfig": ".configuration_value", "PI05ValueModel": ".modeling_value",
           "PI05ValueOutput": ".modeling_value", "PI05ChunkCriticConfig": ".configuration_value",
           "PI05ChunkCritic": ".modeling_value"}
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_attributes(__name__, _PUBLIC)
