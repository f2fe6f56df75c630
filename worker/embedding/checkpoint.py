"""What an embedding checkpoint declares, read from sentence-transformers' files. Owns `EmbeddingSpec`.

A sentence-transformers release is a transformers checkpoint plus:
- `modules.json`: the module chain, here `Transformer` -> `Pooling` [-> `Normalize`] (any other module, e.g. a
  `Dense` projection, is refused with one line: its output would not be the release's);
- `1_Pooling/config.json` (the Pooling module's folder): the pooling mode, in the legacy `pooling_mode_*` flags
  the releases ship or the newer `pooling_mode` key;
- `sentence_bert_config.json`: `max_seq_length` (longer inputs are refused, not truncated);
- `config_sentence_transformers.json` (optional): `prompts` and `default_prompt_name`; the default prompt, when
  one is named, is put before every text input, as `SentenceTransformer.encode` does.
Matryoshka `dimensions` are allowed only where config.json declares it: `matryoshka_dimensions` (a list: the
allowed values) or `is_matryoshka: true` (any value up to the model's dimension).

Plain JSON reads, no sentence-transformers import: it is not needed at run time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

PoolingMode = Literal["cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken"]
ModelKind = Literal["generate", "embed"]
EMBED: ModelKind = "embed"
GENERATE: ModelKind = "generate"

_LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_SUPPORTED_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken")
# The transformers families each architecture runs as: encoders (bidirectional) and decoders (causal).
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "modernbert", "distilbert", "mpnet"})
DECODER_TYPES = frozenset({"qwen2", "qwen3", "mistral", "llama"})


class EmbeddingCheckpointError(ValueError):
    """An embedding checkpoint cbq cannot run as its release defines it: one line naming what."""


@dataclass(frozen=True)
class EmbeddingSpec:
    path: Path
    model_type: str
    pooling: PoolingMode
    normalize: bool
    dimension: int  # the pooled embedding's size (the model's hidden size)
    max_seq_length: int  # inputs longer than this (in tokens) are refused
    prompt: str  # put before every text input ("" for none)
    matryoshka: bool | tuple[int, ...]  # False: no `dimensions`; True: any; a tuple: those values

    @property
    def is_decoder(self) -> bool:
        return self.model_type in DECODER_TYPES

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why `dimensions` cannot be honoured by this model, or None when it can (None and the model's own
        dimension always can)."""
        if dimensions is None or dimensions == self.dimension:
            return None
        if dimensions > self.dimension:
            return f"dimensions={dimensions} is larger than the model's embedding dimension {self.dimension}"
        if self.matryoshka is False:
            return (
                f"this model does not declare Matryoshka embeddings (config.json: is_matryoshka or "
                f"matryoshka_dimensions), so dimensions must be its own {self.dimension}"
            )
        if isinstance(self.matryoshka, tuple) and dimensions not in self.matryoshka:
            allowed = ", ".join(map(str, self.matryoshka))
            return f"dimensions={dimensions} is not one of the model's matryoshka_dimensions ({allowed})"
        return None


def is_embedding_checkpoint(model: str) -> bool:
    """Whether `model` is a local folder holding a sentence-transformers release (`modules.json`)."""
    return (Path(model) / "modules.json").is_file()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EmbeddingCheckpointError(f"{path}: cannot be read as JSON ({exc})") from None


def read_embedding_spec(model: str, tokenizer_max_length: int | None = None) -> EmbeddingSpec:
    """The spec of the sentence-transformers checkpoint in folder `model`. Raises `EmbeddingCheckpointError`."""
    root = Path(model)
    config = _read_json(root / "config.json")
    model_type = config.get("model_type")
    if model_type not in ENCODER_TYPES | DECODER_TYPES:
        known = ", ".join(sorted(ENCODER_TYPES | DECODER_TYPES))
        raise EmbeddingCheckpointError(f"embedding model type {model_type!r} is not supported (cbq runs {known})")
    modules = _read_json(root / "modules.json")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise EmbeddingCheckpointError(
            f"modules.json chains {' -> '.join(kinds)}; cbq runs Transformer -> Pooling [-> Normalize]"
        )
    if modules[0].get("path", "") not in ("", "."):
        raise EmbeddingCheckpointError("modules.json: the Transformer module must be the checkpoint's root folder")
    pooling_config = _read_json(root / modules[1]["path"] / "config.json")
    dimension = pooling_config.get("word_embedding_dimension") or pooling_config.get("embedding_dimension")
    if dimension is None:
        dimension = config.get("hidden_size")
    st_config = root / "sentence_bert_config.json"
    max_seq = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    limits = [v for v in (max_seq, tokenizer_max_length, config.get("max_position_embeddings")) if v]
    return EmbeddingSpec(
        path=root,
        model_type=model_type,
        pooling=_pooling_mode(pooling_config),
        normalize=len(kinds) == 3,
        dimension=int(dimension),
        max_seq_length=int(min(limits)) if limits else 512,
        prompt=_default_prompt(root / "config_sentence_transformers.json"),
        matryoshka=_matryoshka(config),
    )


def _pooling_mode(pooling_config: dict[str, Any]) -> PoolingMode:
    if "pooling_mode" in pooling_config and isinstance(pooling_config["pooling_mode"], str):
        modes = [pooling_config["pooling_mode"]]
    elif "pooling_mode" in pooling_config:
        modes = list(pooling_config["pooling_mode"])
    else:
        modes = [mode for key, mode in _LEGACY_MODES.items() if pooling_config.get(key)]
    if len(modes) != 1 or modes[0] not in _SUPPORTED_MODES:
        raise EmbeddingCheckpointError(
            f"1_Pooling/config.json asks for pooling {modes or 'none'}; cbq pools by exactly one of "
            f"{', '.join(_SUPPORTED_MODES)}"
        )
    if pooling_config.get("include_prompt") is False:
        raise EmbeddingCheckpointError("1_Pooling/config.json: include_prompt false is not supported")
    return modes[0]  # type: ignore[return-value]


def _default_prompt(path: Path) -> str:
    if not path.is_file():
        return ""
    st = _read_json(path)
    name = st.get("default_prompt_name")
    if not name:
        return ""
    prompts = st.get("prompts") or {}
    if name not in prompts:
        raise EmbeddingCheckpointError(f"{path.name}: default_prompt_name {name!r} is not one of its prompts")
    return str(prompts[name])


def _matryoshka(config: dict[str, Any]) -> bool | tuple[int, ...]:
    dims = config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return bool(config.get("is_matryoshka", False))
