"""Run under `torchrun --nproc_per_node 2`: one PPO update (GA 2) on the toy bandit, each rank rolling out its own
seeds. Rank 0 writes the gradient right before the optimizer step (after DDP's all-reduce) and every micro-batch of
every rank, so the test can recompute the update on the union of the rollouts in one process."""

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


def config(out: str, distributed: bool) -> RLConfig:
    return RLConfig(output_dir=out, env="hf_vla_test/PointBandit-v0", num_envs=1, group_size=4, groups_per_update=1,
                    algorithm="ppo",
                    max_steps=1, reward="dense", gradient_accumulation_steps=2, max_grad_norm=0.0, use_cpu=True,
                    ddp_backend="gloo" if distributed else None, report_to=[], disable_tqdm=True, save_strategy="no",
                    eval_strategy="no", eval_on_start=False, log_kl=False, n_action_steps=1, seed=0)


def main(out):
    model, processor = tiny_policy(seed=4, scale=0.05)
    capture = Capture(model)
    trainer = Recording(model, config(out + ".run", True), processing_class=processor, callbacks=[capture])
    trainer.seen = []
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    batches = gather_object([trainer.seen])
    if torch.distributed.get_rank() == 0:
        torch.save({"grads": capture.grads, "batches": [b for rank in batches for b in rank],
                    "world_size": trainer.accelerator.num_processes}, out)


if __name__ == "__main__":
    main(sys.argv[1])
    from engines import leave

    leave()
