"""Training: `VLATrainer` and its arguments, the flow-matching and token losses, fp32 master weights, EMA, checkpoints
and resume, preemption, engines (DDP / FSDP2 / DeepSpeed), start-up checks and closed-loop rollouts during training.
`python -m hf_vla.train` wires them."""
