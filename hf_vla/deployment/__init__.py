"""The deployment contract (`contract.py`): how a checkpoint must be run (its cameras and their recorded sizes, actions
per chunk, heads, the benchmark its data came from), saved beside the weights of every checkpoint and read by
evaluation, serving, RL, the hub tools and the lerobot plugin. It sits below every room that reads it and imports
none of them (the env registry excepted)."""
