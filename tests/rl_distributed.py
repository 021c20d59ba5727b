"""Run under `torchrun --nproc_per_node 2`: one PPO update (GA 2) on the toy bandit, each rank rolling out its own
seeds and replaying its shard of the expert data (`bc_datasets`, the JSON of the second argument). Rank 0 writes the gradient right before the optimizer step (after DDP's all-reduce) and every micro-batch of
every rank (rollout batches and replayed expert batches), so the test can recompute the update on the union of the
rollouts and the replayed batches in one process."""

import sys

import torch
from accelerate.utils import gather_object
from distributed_step import Capture
from test_rl import tiny_policy

from hf_vla.rl import RLConfig, RLTrainer


class Recording(RLTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append({k: v.detach().cpu() for k, v in inputs.items()})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _next_replay_batch(self):
        batch = super()._next_replay_batch()
        self.replayed.append({k: v.detach().cpu() for k, v in batch.items()})
        return batch


def config(out: str, distributed: bool, bc_datasets: list | None = None, gradient_accumulation_steps: int = 2):
    return RLConfig(output_dir=out, env="hf_vla_test/PointBandit-v0", num_envs=1, group_size=4, groups_per_update=1,
                    algorithm="ppo",
                    max_steps=1, reward="dense", gradient_accumulation_steps=gradient_accumulation_steps,
                    max_grad_norm=0.0, use_cpu=True, bc_datasets=bc_datasets, per_device_train_batch_size=2,
                    stream_open_blocks=1, dataloader_num_workers=0,
                    ddp_backend="gloo" if distributed else None, report_to=[], disable_tqdm=True, save_strategy="no",
                    eval_strategy="no", eval_on_start=False, log_kl=False, n_action_steps=1, seed=0)


def main(out, bc_datasets):
    model, processor = tiny_policy(seed=4, scale=0.05)
    capture = Capture(model)
    trainer = Recording(model, config(out + ".run", True, bc_datasets), processing_class=processor,
                        callbacks=[capture])
    trainer.seen, trainer.replayed = [], []
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    batches = gather_object([trainer.seen])
    replayed = gather_object([trainer.replayed])
    if torch.distributed.get_rank() == 0:
        torch.save({"grads": capture.grads, "batches": [b for rank in batches for b in rank],
                    "replayed": [b for rank in replayed for b in rank],
                    "world_size": trainer.accelerator.num_processes}, out)


if __name__ == "__main__":
    import json

    main(sys.argv[1], json.loads(sys.argv[2]))
    from engines import leave

    leave()
