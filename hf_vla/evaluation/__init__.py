"""Closed-loop evaluation: the episode loop shared by `python -m hf_vla.evaluate`, rollouts during training and RL."""
