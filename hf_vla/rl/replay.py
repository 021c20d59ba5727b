"""Expert data replayed beside the RL loss (`RLConfig.bc_datasets`, `bc_coef`).

Each update's micro-batch adds `bc_coef` times supervised training's loss (`VLATrainer.compute_loss`: the same
flow-matching objective, seeded noise and time, loss aggregation and NaN guard) on one batch of the expert datasets,
read by supervised training's episode-shuffle stream and normalised with the start policy's statistics (the policy's
action space, whatever the replayed data's own statistics are). It is DAPG's recipe (Rajeswaran et al., arXiv
1709.10087: the policy gradient plus the demonstrations' behaviour-cloning gradient) for a flow policy: the expert
term holds what supervised training taught while the rollouts' term moves the policy, so the learning rate can rise
without training on its own samples collapsing the policy (docs/rl.md).
"""

from __future__ import annotations

from hf_vla.errors import ConfigError


class HeadIndexCollator:
    """The policy's collator with each sample's head index (`dataset_index`, in the replayed mixture's head order)
    mapped to the policy processor's order. Picklable for DataLoader workers."""

    def __init__(self, collator, index: list[int]):
        self.collator, self.index = collator, index

    def __call__(self, samples: list[dict]):
        for sample in samples:
            sample["dataset_index"] = self.index[int(sample["dataset_index"])]
        return self.collator(samples)


def replay_stream(args, processor, config):
    """(stream, collate_fn) of `args.bc_datasets` for a policy with `processor` and `config`: the episode-shuffle
    stream of this rank (batch `per_device_train_batch_size`, seed `data_seed` or `seed`, `stream_open_blocks`) and
    the processor's collator. Every replayed head must be one of the policy's (the same dataset `name` and
    `control_mode` as in its supervised training)."""
    from hf_vla.data import VLACollator, WeightedDatasetMixture
    from hf_vla.serving.policy import stat_dims

    mixture = WeightedDatasetMixture(args.bc_datasets, chunk_size=config.chunk_size)
    heads = list(getattr(processor, "head_names", None) or [])
    unknown = [head for head in mixture.head_names if head not in heads]
    if unknown:
        raise ConfigError(f"bc_datasets: head(s) {unknown} are not the policy's {heads}; name each replayed dataset "
                          "(its `name` and `control_mode`) as in the policy's supervised training, whose "
                          "normalisation it is read with")
    for source in mixture.sources:
        head = source.norm_key
        theirs = stat_dims(processor.norm_stats[head]["actions"])
        if source.action_dim != theirs:
            raise ConfigError(f"bc_datasets: dataset {source.name!r} has {source.action_dim} action dims, the policy's "
                              f"head {head!r} {theirs}")
    stream, _ = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=config.chunk_size)
    # the replayed loss is supervised training's flow loss: no token targets, whatever the policy was trained with
    collator = VLACollator(processor, targets=False)
    return stream, HeadIndexCollator(collator, [heads.index(h) for h in mixture.head_names])


__all__ = ["HeadIndexCollator", "replay_stream"]
