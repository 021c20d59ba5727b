"""Hub ids in, with no manual step: lerobot checkpoints converted on load (and cached), dataset files and keep-ranges
files fetched on demand, Hub errors as one line.

    import hf_vla
    from transformers import AutoModel, AutoProcessor

    path = hf_vla.resolve_pretrained("lerobot/pi05_base")   # converted once, then read from the cache
    model, processor = AutoModel.from_pretrained(path), AutoProcessor.from_pretrained(path)

`python -m hf_vla.train` (`model_name_or_path`), `hf_vla.evaluate --checkpoint` and `hf_vla.serve --checkpoint` call
`resolve_pretrained` themselves. A lerobot pi0 / pi0.5 checkpoint (a `config.json` with lerobot's `type` and no
`model_type`, beside `model.safetensors`), by Hub id or directory, is converted by `hf_vla.hub.convert.convert_checkpoint`
(dims read from the weights, lerobot's normaliser statistics carried over, the tokenizer its pre-processor names)
into `$HF_VLA_CACHE/converted/<id>--<revision or content key>`, so the next run loads the copy; an hf_vla or
transformers checkpoint passes through unchanged. Everything from the Hub goes through huggingface_hub (its cache,
resume of interrupted downloads, `HF_HUB_OFFLINE=1`: what is cached works offline).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hf_vla.cli import HUB_ID
from hf_vla.errors import ConfigError

if TYPE_CHECKING:
    from hf_vla.deployment.contract import DeploymentConfig

logger = logging.getLogger("hf_vla.hub.resolve")
DEFAULT_TOKENIZER = "google/paligemma-3b-pt-224"  # what lerobot's pi0 / pi0.5 pre-processors load
CONVERTER_VERSION = 1  # part of the cache key: a changed conversion converts again
LEROBOT_FILES = ["config.json", "model.safetensors", "policy_preprocessor*.json", "policy_postprocessor*.json",
                 "*normalizer_processor*.safetensors"]


def cache_dir() -> Path:
    """hf_vla's own cache (`hf_vla.storage.cache_root`: `$HF_VLA_CACHE`, else `$HF_HOME/hf_vla`)."""
    from hf_vla.storage import cache_root

    return cache_root()


def hub_error(error: BaseException, what: str, revision: str | None = None) -> ConfigError:
    """One line for a Hub failure, naming the id (and revision) and what to do."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(error, RevisionNotFoundError):
        return ConfigError(f"{what}: revision {revision!r} not found on the Hub")
    if isinstance(error, GatedRepoError):
        return ConfigError(f"{what}: a gated repository; accept its terms on the Hub and log in (`hf auth login`)")
    if isinstance(error, RepositoryNotFoundError):
        return ConfigError(f"{what}: no such repository on the Hub (or it is private: log in with `hf auth login`)")
    if isinstance(error, LocalEntryNotFoundError | OfflineModeIsEnabled):  # (a subclass of EntryNotFoundError)
        return ConfigError(f"{what}{at} is not in the local Hub cache and the Hub cannot be reached (HF_HUB_OFFLINE="
                           f"{os.environ.get('HF_HUB_OFFLINE', '0')}): download it once with a connection")
    if isinstance(error, EntryNotFoundError):
        return ConfigError(f"{what}{at}: {str(error).strip().splitlines()[0]}")
    return ConfigError(f"{what}{at}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}")


GATED = {"google/paligemma-3b-pt-224", "google/paligemma-3b-pt-448", "google/paligemma-3b-pt-896",
         "google/paligemma2-3b-pt-224"}  # the tokenizers and VLMs pi0 / pi0.5 users load


def load_error(error: BaseException, what: str, name: str) -> ConfigError:
    """One line for a failed `from_pretrained(name)` (transformers wraps the Hub's errors in OSError): a gated repo
    says so and how to get access, an uncached one offline says that."""
    chain, cause = [], error
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    from huggingface_hub.errors import GatedRepoError

    text = " ".join(str(e) for e in chain).lower()
    gated = any(isinstance(e, GatedRepoError) for e in chain) or "gated repo" in text
    offline = "offline" in text or "couldn't connect" in text or "cannot find the requested files" in text
    access = (f"{name!r} is a gated repository: accept its license at https://huggingface.co/{name}, then log in "
              "(`hf auth login` or HF_TOKEN)")
    if gated:
        return ConfigError(f"{what}: {access}")
    if offline:
        extra = f"; note: {access}" if name in GATED else ""
        return ConfigError(f"{what}: {name!r} is not in the local Hub cache and the Hub cannot be reached "
                           f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): download it once with a "
                           f"connection{extra}")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ConfigError(f"{what}: {first}")


def _hub_call(function, what: str, *args, **kwargs):
    """`function(*args, **kwargs)` (a huggingface_hub download), its Hub errors as one line naming `what`."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        return function(*args, **kwargs)
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, ValueError) as error:
        raise hub_error(error, what, kwargs.get("revision")) from error


def is_lerobot_checkpoint(config: dict) -> bool:
    """lerobot's policy `config.json`: a `type` a registered family converts from (pi0, pi05) and no transformers
    `model_type`."""
    from hf_vla.registry import lerobot_types

    return isinstance(config, dict) and config.get("type") in lerobot_types() and "model_type" not in config


def _preprocessor_tokenizer(directory: Path) -> str | None:
    """The tokenizer lerobot's saved pre-processor loads (its tokenizer step's `tokenizer_name`)."""
    for path in sorted(directory.glob("policy_preprocessor*.json")):
        try:
            steps = json.loads(path.read_text()).get("steps", [])
        except (json.JSONDecodeError, AttributeError):
            continue
        for step in steps:
            name = (step.get("config") or {}).get("tokenizer_name") if isinstance(step, dict) else None
            if name:
                return name
    return None


def _local_key(directory: Path) -> str:
    """A content key of a local lerobot checkpoint: its config's bytes, the weights' size and modification time."""
    weights = (directory / "model.safetensors").stat()
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    digest.update(f"{weights.st_size}:{weights.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def resolve_pretrained(name_or_path: str | os.PathLike, revision: str | None = None, tokenizer=None,
                       label: str | None = None) -> str:
    """A local directory or Hub id that `AutoModel` / `AutoProcessor.from_pretrained` load.

    A lerobot pi0 / pi0.5 checkpoint is converted (once: the copy is cached under `cache_dir()/converted`, keyed by
    the Hub commit or the local files' content) and the copy's path returned; anything else is returned as given.
    `tokenizer`: a name, path or tokenizer for the converted processor (default: the one lerobot's pre-processor
    names, else PaliGemma's). `label` names the argument in error messages (e.g. `model_name_or_path`).
    """
    source = str(name_or_path)
    path = Path(source).expanduser()
    if path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        return merged_adapter(path, revision=revision, label=label)
    if path.is_dir():
        config_file = path / "config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except json.JSONDecodeError as error:
            raise ConfigError(f"{config_file}: not valid JSON ({error})") from error
        if not is_lerobot_checkpoint(config):
            return source
        key = f"{path.resolve().name}--{_local_key(path)}"
        return _converted(path, key, tokenizer, source)
    if source.startswith((".", "/", "~")) or not HUB_ID.match(source) or source.count("/") != 1:
        raise ConfigError(f"{label + '=' if label else ''}{source!r}: no such directory, and not a Hub id "
                          "(namespace/name)")
    from huggingface_hub import hf_hub_download, snapshot_download

    what = f"{label}={source!r} (Hub checkpoint)" if label else f"Hub checkpoint {source!r}"
    config_file = _hub_call(hf_hub_download, what, source, "config.json", revision=revision)
    try:
        config = json.loads(Path(config_file).read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{what}: config.json is not valid JSON ({error})") from error
    if not is_lerobot_checkpoint(config):
        return source
    snapshot = Path(_hub_call(snapshot_download, what, source, revision=revision,
                              allow_patterns=LEROBOT_FILES))
    commit = snapshot.name  # the snapshot folder is named by the commit it holds
    return _converted(snapshot, f"{source.replace('/', '--')}--{commit}", tokenizer, source)


# files of a LoRA checkpoint that are not the processor's: left out of its merged copy

def resolve_contract(checkpoint: str | os.PathLike, revision: str | None = None) -> DeploymentConfig | None:
    """The deployment contract (`hf_vla.deployment.contract.read`) of what `hf_vla.evaluate` / `hf_vla.serve` take: a
    directory or Hub id (a lerobot checkpoint is converted first, as loading it does); a damaged contract is a
    `ConfigError` naming the file."""
    from hf_vla.deployment.contract import read

    resolved = resolve_pretrained(checkpoint, revision=revision)
    try:
        return read(resolved, revision=None if resolved != str(checkpoint) else revision)
    except ValueError as error:
        raise ConfigError(str(error)) from error


_TRAINING_FILES = ("adapter_", "optimizer", "scheduler", "rng_state", "training_args", "trainer_state", "ema_", "README",
                   "stream_state", "hf_vla_checkpoint")


def merged_adapter(directory: str | os.PathLike, revision: str | None = None, label: str | None = None) -> str:
    """A LoRA adapter directory (a `checkpoint-N` of a LoRA run, or the `adapter/` of its output) merged with its base
    (`base_model_name_or_path` of adapter_config.json, itself resolved: a Hub id, a lerobot checkpoint, a local
    directory), once, into `cache_dir()/merged/`; the processor files come from the adapter's directory (the
    Trainer saves them beside the adapters), else from its parent or the base. Returns the merged copy's path."""
    directory = Path(directory).expanduser()
    what = f"{label + '=' if label else ''}{str(directory)!r}"
    try:
        adapter_config = json.loads((directory / "adapter_config.json").read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{what}: adapter_config.json is not valid JSON ({error})") from error
    base = adapter_config.get("base_model_name_or_path")
    weights = next((directory / n for n in ("adapter_model.safetensors", "adapter_model.bin")
                    if (directory / n).is_file()), None)
    if weights is None:
        raise ConfigError(f"{what}: a LoRA adapter directory without adapter_model.safetensors")
    stat = weights.stat()
    digest = hashlib.sha256((directory / "adapter_config.json").read_bytes())
    digest.update(f"{stat.st_size}:{stat.st_mtime_ns}:{directory.resolve()}".encode())
    target = cache_dir() / "merged" / f"{directory.resolve().name}--{digest.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        logger.info("%s: LoRA adapters, using their merged copy %s", directory, target)
        return str(target)
    if not base:
        raise ConfigError(f"{what}: LoRA adapters whose adapter_config.json names no base model "
                          "(base_model_name_or_path); load them onto their base with peft yourself")
    base_path = Path(base).expanduser()
    if not base_path.is_dir() and (base.startswith((".", "/", "~")) or not HUB_ID.match(base)):
        raise ConfigError(f"{what}: LoRA adapters on the base model {base!r} (adapter_config.json "
                          "base_model_name_or_path), which no longer exists: a run trained from a freshly built model "
                          "has no base to load; use its output directory (the merged model) instead")
    resolved = resolve_pretrained(base, label=f"{what}'s base model")
    logger.info("%s: LoRA adapters; merging them into their base %s once, into %s", directory, base, target)
    import shutil
    import tempfile

    from peft import PeftModel
    from transformers import AutoModel

    import hf_vla.models.auto  # noqa: F401  (registers pi05 with the Auto classes)

    try:
        model = AutoModel.from_pretrained(resolved)
    except (OSError, ValueError) as error:
        raise load_error(error, f"{what}: its base model {base!r} could not be loaded", base) from error
    merged = PeftModel.from_pretrained(model, directory).merge_and_unload()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        merged.save_pretrained(staging)
        sources = [directory, directory.parent, Path(resolved)]
        processor_dir = next((d for d in sources if (d / "processor_config.json").is_file()), None)
        if processor_dir is not None:
            for item in processor_dir.iterdir():
                if item.is_file() and not item.name.startswith(_TRAINING_FILES) and not (staging / item.name).exists():
                    shutil.copy2(item, staging / item.name)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _converted(directory: Path, key: str, tokenizer, source: str) -> str:
    from hf_vla.hub.convert import convert_checkpoint

    target = cache_dir() / "converted" / f"{key}--v{CONVERTER_VERSION}"
    if (target / "config.json").is_file() and (target / "processor_config.json").is_file():
        logger.info("%s: lerobot checkpoint, using its converted copy %s", source, target)
        return str(target)
    tokenizer = tokenizer or _preprocessor_tokenizer(directory) or DEFAULT_TOKENIZER
    logger.info("%s: a lerobot checkpoint; converting it once into %s", source, target)
    import shutil

    shutil.rmtree(target, ignore_errors=True)  # hf_vla's own cache: an incomplete earlier conversion
    # staged, renamed into place; a base checkpoint without statistics converts (fine-tuning computes them)
    convert_checkpoint(directory, target, tokenizer=tokenizer, overwrite=True, require_stats=False)
    return str(target)


# ---- datasets ----------------------------------------------------------------------------------------------------
def lerobot_home() -> Path:
    """lerobot's dataset cache (`$HF_LEROBOT_HOME`, default `$HF_HOME/lerobot`), where `<repo_id>/` is a dataset."""
    from lerobot.utils import constants

    return Path(constants.HF_LEROBOT_HOME)


def download_dataset_files(repo_id: str, revision: str | None, root: Path, files: list[str]) -> None:
    """Fetch `files` (paths relative to the dataset root) of a Hub dataset into `root`, as lerobot's own download does
    (`snapshot_download` with `local_dir`: a progress bar, resumed partial files, nothing else of the repository)."""
    import huggingface_hub

    what = f"dataset {repo_id!r}"
    logger.info("%s: downloading %d file(s) into %s", what, len(files), root)
    _hub_call(huggingface_hub.snapshot_download, what, repo_id, repo_type="dataset", revision=revision,
              local_dir=str(root), allow_patterns=sorted(files))


# ---- files by reference: hf://... or a URL ----------------------------------------------------------------------
_HF_URI = re.compile(r"^hf://(?:(?P<kind>datasets|spaces)/)?(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>[^/]+))?/(?P<path>.+)$")


def fetch_file(reference: str, what: str) -> Path:
    """A local copy of `hf://[datasets/]namespace/name[@revision]/path` (through the Hub cache), an http(s) URL or a
    public `gs://bucket/path` object (downloaded once into `cache_dir()/downloads`, then reused, offline too)."""
    if reference.startswith("gs://"):  # a public Cloud Storage object (openpi's assets) has an https address
        reference = "https://storage.googleapis.com/" + reference[len("gs://"):]
    match = _HF_URI.match(reference)
    if match:
        from huggingface_hub import hf_hub_download

        kind = {"datasets": "dataset", "spaces": "space"}.get(match["kind"], "model")
        return Path(_hub_call(hf_hub_download, f"{what} {reference!r}", match["repo"], match["path"],
                              repo_type=kind, revision=match["rev"]))
    if reference.startswith(("http://", "https://")):
        import urllib.request

        name = reference.rstrip("/").rsplit("/", 1)[-1] or "file"
        target = cache_dir() / "downloads" / f"{hashlib.sha256(reference.encode()).hexdigest()[:16]}-{name}"
        if target.is_file():
            return target
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
            raise ConfigError(f"{what} {reference!r} is not downloaded yet and HF_HUB_OFFLINE is set")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".incomplete")
        try:
            with urllib.request.urlopen(reference, timeout=60) as response, open(partial, "wb") as handle:
                while chunk := response.read(1 << 20):
                    handle.write(chunk)
        except OSError as error:
            raise ConfigError(f"{what} {reference!r} could not be downloaded: {error}") from error
        os.replace(partial, target)
        return target
    raise ConfigError(f"{what} {reference!r}: expected a local file, hf://[datasets/]namespace/name/path, gs://... "
                      "or a URL")


def is_remote(reference) -> bool:
    return isinstance(reference, str) and reference.startswith(("hf://", "gs://", "http://", "https://"))


def _declared_model_type(checkpoint: str | Path) -> str | None:
    """The `model_type` a local checkpoint's config.json declares (None: not a local directory, or none declared)."""
    path = Path(checkpoint) / "config.json"
    try:
        declared = json.loads(path.read_text()).get("model_type") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None  # transformers reports an unreadable config itself
    return declared if isinstance(declared, str) else None


def load_config(checkpoint: str | Path, revision: str | None = None):
    """A checkpoint's config, as every command reads it: by the config class of the family registered for the model
    type its config.json declares (an unregistered one: a `ConfigError` naming the registered families, where
    transformers would ask for remote code; transformers' own pi0.5 is "pi05" too, which hf_vla's config refuses
    naming the file), `AutoConfig` for a Hub id; a field the class refuses is one line naming the file."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    import hf_vla.models.auto  # noqa: F401  (registers hf_vla's model types with the Auto classes)
    from hf_vla.registry import get_policy

    declared = _declared_model_type(checkpoint)
    config_class = get_policy(declared, f"{checkpoint}: config.json model_type").load("config") \
        if declared is not None else AutoConfig
    try:
        return config_class.from_pretrained(checkpoint, revision=revision)
    except StrictDataclassError as error:  # a field the config class refuses (e.g. subtask_max_tokens 0): one line
        cause = error.__cause__ or error
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ValueError(f"{checkpoint}/config.json: {first}") from error


def load_pretrained(checkpoint: str | Path, revision: str | None = None, dtype=None):
    """The policy and its processor from a directory or Hub id, as every command loads them: the model and processor
    classes of the family registered for its config's model_type (`hf_vla.registry`; for transformers' pi0 its
    `PI0ForConditionalGeneration`, not `AutoModel`'s headless `PI0Model`, and hf_vla's `PI0HeadProcessor`). `OSError` /
    `ValueError` as transformers raises them; a `ConfigError` for an unregistered model type."""
    from hf_vla.hub.convert import check_weight_files
    from hf_vla.registry import get_policy

    config = load_config(checkpoint, revision)
    family = get_policy(config.model_type, f"{checkpoint}: config.json model_type")
    check_weight_files(checkpoint)  # missing or cut-off weights: one line naming the file, not safetensors' error
    if family.value_model:
        raise ValueError(f"{checkpoint}: a {config.model_type!r} checkpoint predicts returns, not actions (a value "
                         "model: python -m hf_vla.recap annotate --value takes it)")
    if family.chunk_critic:
        raise ValueError(f"{checkpoint}: a {config.model_type!r} checkpoint scores action chunks, not a policy (a "
                         "chunk critic: evaluate and serve take it as --critic beside --best_of)")
    model = family.load("model").from_pretrained(checkpoint, revision=revision, dtype=dtype)
    return model, family.load("processor").from_pretrained(checkpoint, revision=revision)


def load_scorer(checkpoint: str | Path, device: str, flag: str, kind: str, hint: str):
    """A model that scores rather than acts (a family with `kind` set: `value_model`, `chunk_critic`), eval mode on
    `device`, and its processor; ConfigError in one line naming `flag` for a checkpoint of another kind (`hint`: how
    to train the right one)."""
    from transformers import AutoConfig

    import hf_vla.models.auto  # noqa: F401  (registers hf_vla's model types with AutoConfig)
    from hf_vla.errors import ConfigError
    from hf_vla.hub.convert import check_weight_files
    from hf_vla.registry import find_policy

    try:
        config = AutoConfig.from_pretrained(str(checkpoint))
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{flag} {str(checkpoint)!r}: no loadable config ({first})") from None
    family = find_policy(config.model_type)
    if family is None or not getattr(family, kind):
        name = family.name if family is not None else config.model_type
        raise ConfigError(f"{flag} {str(checkpoint)!r}: a {name!r} checkpoint, not {hint}")
    check_weight_files(checkpoint)
    model = family.load("model").from_pretrained(str(checkpoint)).eval().to(device)
    return model, family.load("processor").from_pretrained(str(checkpoint))


__all__ = ["cache_dir", "download_dataset_files", "fetch_file", "is_lerobot_checkpoint", "load_config", "load_pretrained", "load_scorer", "resolve_contract",
           "resolve_pretrained"]
