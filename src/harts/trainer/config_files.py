"""A ``harts train`` config as a file: the TOML read and parsed (:func:`parse_config`), then the
files it names checked to exist, apart from parsing so that configs can be built in memory."""

from __future__ import annotations

from pathlib import Path

from harts.trainer.config import FROM_POLICY, INITIAL, TrainConfig, parse_config
from harts.trainer.toml_sections import read_toml_config

__all__ = ["load_config", "check_paths"]


def check_paths(config: TrainConfig) -> None:
    """The files the config names exist (checked apart from parsing, so configs can be built in memory)."""
    if not config.data.path.is_file():
        raise FileNotFoundError(f"data.path: {config.data.path}: no such rollout file")
    if config.data.tokenizer is not None and not config.data.tokenizer.is_dir():
        raise FileNotFoundError(f"data.tokenizer: {config.data.tokenizer}: no such directory")
    path = config.model.path
    if path is not None and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path: {path}: not a local Hugging Face model directory (no config.json); "
            f"harts train reads local directories only"
        )
    for key, file in (
        ("eval.file", config.eval and config.eval.file),
        ("samples.prompts", config.samples and config.samples.prompts),
    ):
        if file and not file.is_file():
            raise FileNotFoundError(f"{key}: {file}: no such file")
    if config.samples is not None and config.samples.tokenizer and not config.samples.tokenizer.is_dir():
        raise FileNotFoundError(f"samples.tokenizer: {config.samples.tokenizer}: no such directory")
    ref = config.reference
    if ref is not None and not ref.initial and not (Path(ref.model) / "config.json").is_file():
        raise FileNotFoundError(
            f"reference.model: {ref.model}: not a local Hugging Face model directory (no config.json); "
            f'give one, or "{INITIAL}" for the run\'s starting weights'
        )
    critic = config.critic
    if critic is not None and not critic.from_policy and not (Path(critic.model) / "config.json").is_file():
        raise FileNotFoundError(
            f"critic.model: {critic.model}: not a local Hugging Face model directory (no config.json); "
            f'give one, or "{FROM_POLICY}" for the policy\'s starting weights under a fresh value head'
        )


def load_config(path: str | Path) -> TrainConfig:
    """Read and check a ``harts train`` TOML file; every error names the file and the key."""

    def parse(table, base, **where) -> TrainConfig:
        config = parse_config(table, base, **where)
        check_paths(config)
        return config

    return read_toml_config(path, parse)
