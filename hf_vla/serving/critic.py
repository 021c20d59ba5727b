"""Best-of-N's learned selector: a chunk critic (`PI05ChunkCritic`, policy family `pi05_chunk_critic`) beside a policy,
scoring each observation's candidate chunks by their expected return (`hf_vla.serving.selection`, selector `critic`).

The critic reads the policy's candidates as they are sampled (normalised actions), so it must share the policy's
action space: the same chunk size and action width, and the same action statistics (normalisation and relative dims)
for the head it scores. Anything else is refused in one line before the first observation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hf_vla.errors import ConfigError


@dataclass
class ChunkCriticScorer:
    """A loaded chunk critic, its processor and where it came from."""

    model: torch.nn.Module
    processor: object
    path: str

    def check_policy(self, policy, processor, flag: str = "--critic") -> None:
        """ConfigError, one line, where the critic cannot score this policy's chunks."""
        theirs, ours = policy.config, self.model.config
        for name in ("chunk_size", "max_action_dim"):
            if getattr(theirs, name) != getattr(ours, name):
                raise ConfigError(f"{flag} {self.path}: {name}={getattr(ours, name)}, the policy's is "
                                  f"{getattr(theirs, name)} (a critic of another action space)")
        for head, stats in processor.norm_stats.items():
            mine = self.processor.norm_stats.get(head)
            if mine is None:
                raise ConfigError(f"{flag} {self.path}: no statistics for the policy's head {head!r} (it knows "
                                  f"{', '.join(sorted(self.processor.norm_stats))}): a critic of another contract")
            if not _same(stats.get("actions"), mine.get("actions")):
                raise ConfigError(f"{flag} {self.path}: head {head!r}'s action statistics differ from the policy's (a "
                                  "critic of another action space; train it with --norm_stats_from the policy)")

    @torch.no_grad()
    def scores(self, rows: dict, head: str, candidates: torch.Tensor, dims: int) -> torch.Tensor:
        """The expected return `[N]` of one observation's candidates `[N, T, d]` (normalised; dims past `dims`, the
        head's own, zeroed). `rows`: the observation as the runner batches it (images, states, tasks, camera_mask)."""
        device = next(self.model.parameters()).device
        inputs = self.processor(images=rows["images"], text=rows["tasks"], state=rows["states"], head=head,
                                camera_mask=rows["camera_mask"])
        inputs = {k: v.to(device) for k, v in inputs.items()
                  if k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}
        mask = torch.zeros(1, candidates.shape[-1], device=device)
        mask[:, :dims] = 1.0
        return self.model.chunk_values(candidates[None].to(device).float(), action_dim_mask=mask, **inputs)[0].cpu()


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if set(a) != set(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list | tuple | np.ndarray) and isinstance(y, list | tuple | np.ndarray):
            x, y = np.asarray(x), np.asarray(y)
            if x.shape != y.shape or not np.allclose(x.astype(float), y.astype(float), rtol=1e-6, atol=1e-6):
                return False
        elif x != y:
            return False
    return True


def load_critic(checkpoint: str | Path, device: str = "cpu", flag: str = "--critic") -> ChunkCriticScorer:
    """A chunk critic from a directory (or Hub id) trained with `python -m hf_vla.train` and policy
    `pi05_chunk_critic`; ConfigError, one line, for anything else."""
    from hf_vla.hub.resolve import load_scorer

    model, processor = load_scorer(checkpoint, device, flag, "chunk_critic", "a chunk critic (train one with python "
                                   "-m hf_vla.train and policy pi05_chunk_critic; docs/best_of_n.md)")
    return ChunkCriticScorer(model.requires_grad_(False), processor, str(checkpoint))


@dataclass(frozen=True)
class BestOfPlan:
    """A command's best-of-N: the candidates per observation, the selector and the chunk critic (a directory or Hub id;
    None: none), from the flags or the checkpoint's contract (`source`: "flag", "checkpoint" or "default")."""

    best_of: int = 1
    selector: str = "medoid"
    critic: str | None = None
    source: str = "default"

    def record(self) -> dict:
        return {"candidates": self.best_of, "selector": self.selector, **({"critic": self.critic} if self.critic
                                                                         else {})}

    def runner_kwargs(self, device: str = "cpu") -> dict:
        """`PolicyRunner` settings (the critic loaded on `device`); {} for one sample."""
        if self.best_of < 2:
            return {}
        critic = None if self.critic is None else load_critic(self.critic, device=device)
        return {"best_of": self.best_of, "selector": self.selector, "critic": critic}


def plan_best_of(best_of: int | None, selector: str | None, critic: str | None, contract,
                 checkpoint: str | Path | None = None, revision: str | None = None) -> BestOfPlan:
    """The flags (`--best_of`, `--selector`, `--critic`; None: not given) over the contract's bundled best-of-N
    (`DeploymentConfig.best_of`, None: none): `best_of` None takes the contract's candidates (else 1); its critic
    (inside `checkpoint`) is used unless `--critic` names another or `--selector` another selector. ConfigError, one
    line, for flags that cannot run together."""
    from hf_vla.serving.selection import check_selection_flags

    bundle = (getattr(contract, "best_of", None) or None) if contract is not None else None
    source = "flag" if best_of is not None or critic is not None or selector is not None else "default"
    if best_of is None:
        best_of = int(bundle["candidates"]) if bundle else 1
        source = "checkpoint" if bundle and source == "default" else source
    if bundle and critic is None and bundle.get("critic") and best_of > 1 and selector in (None, "critic"):
        critic = bundled_critic(checkpoint, bundle["critic"], revision)
    if bundle and selector is None and critic is None and best_of > 1:
        selector = bundle.get("selector") if bundle.get("selector") != "critic" else None
    return BestOfPlan(best_of, check_selection_flags(best_of, selector, critic), critic, source)


def bundled_critic(checkpoint: str | Path | None, folder: str, revision: str | None = None) -> str:
    """The chunk critic a checkpoint bundles (`folder` inside it: a local path, or the Hub repo's folder downloaded)."""
    if checkpoint is None:
        raise ConfigError(f"the contract bundles a chunk critic ({folder}/) but names no checkpoint to find it in")
    local = Path(checkpoint).expanduser()
    if local.is_dir():
        path = local / folder
        if not (path / "config.json").is_file():
            raise ConfigError(f"{local}: its deployment contract bundles a chunk critic at {folder}/, which is missing "
                              "(copy the whole checkpoint, or pass --best_of 1 / --critic PATH)")
        return str(path)
    from huggingface_hub import snapshot_download

    from hf_vla.hub.resolve import _hub_call

    root = _hub_call(snapshot_download, f"the chunk critic of Hub checkpoint {str(checkpoint)!r}", str(checkpoint),
                     revision=revision, allow_patterns=[f"{folder}/*"])
    return str(Path(root) / folder)


CRITIC_FOLDER = "critic"


def bundle_critic(policy: Path, critic: str, output: Path, best_of: int, overwrite: bool = False) -> Path:
    """`output`: the policy checkpoint `policy` with the chunk critic `critic` in its `critic/` folder and its contract
    recording best-of-`best_of` with the critic, which evaluate / serve / record and the lerobot plugin then run.
    The critic is loaded and checked against the policy first (action space, statistics: one line)."""
    import shutil

    from hf_vla.deployment import contract as contracts
    from hf_vla.hub.convert import _check_paths
    from hf_vla.serving.policy import load_policy
    from hf_vla.serving.selection import check_best_of_flag
    from hf_vla.storage import OUTPUT_MARKER, replace_dir, staging_dir, write_marker

    left_out = ("checkpoint-*", "rollouts", "runs", OUTPUT_MARKER)  # training states, evaluations, the old marker
    check_best_of_flag(best_of)
    if best_of < 2:
        raise ConfigError(f"--best_of {best_of}: a critic picks among 2 or more candidate chunks")
    deployment = contracts.read(policy)
    if deployment is None:
        raise ConfigError(f"--input {str(policy)!r}: no deployment contract ({contracts.FILE_NAME}) to record the "
                          "critic in: an hf_vla checkpoint (a converted lerobot one: convert it first)")
    critic_dir = Path(critic).expanduser()
    if not critic_dir.is_dir():
        raise ConfigError(f"--critic {critic!r}: a local directory (a chunk critic trained with policy "
                          "pi05_chunk_critic)")
    _check_paths(policy, output, overwrite, inputs={"--critic": critic_dir})
    load_policy(policy, best_of=best_of, selector="critic", critic=load_critic(critic_dir))  # refuses a misfit
    staging = staging_dir(output, "bundling")
    shutil.copytree(policy, staging, ignore=shutil.ignore_patterns(*left_out, CRITIC_FOLDER))
    shutil.copytree(critic_dir, staging / CRITIC_FOLDER, ignore=shutil.ignore_patterns(*left_out))
    deployment.best_of = {"candidates": best_of, "selector": "critic", "critic": CRITIC_FOLDER}
    deployment.save(staging)
    write_marker(staging, "hf_vla_checkpoint", source=str(policy), critic=str(critic_dir))
    replace_dir(staging, output)
    return output


__all__ = ["BestOfPlan", "ChunkCriticScorer", "bundle_critic", "bundled_critic", "load_critic",
           "plan_best_of"]
