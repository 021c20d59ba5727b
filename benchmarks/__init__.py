"""hf_vla's benchmarks: see `benchmarks/common.py`."""
