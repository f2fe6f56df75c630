"""The check of a model name before anything loads. Owns what counts as a plausible `--model` value.

A value is a preset, an existing local folder, or a hub id (`org/name`, or a bare name already in the local
Hugging Face cache). Anything else fails at once with the closest preset or folder, instead of after the hub
client's retries (26 s without a network).
"""

from __future__ import annotations

import difflib
import os
import re

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub spells repository ids


class UnknownModel(ValueError):
    """The model name is neither a preset, a local folder nor a plausible hub id; the message says so in one
    line, with the closest candidate."""


def check_model_name(name: str, presets: list[str]) -> None:
    """Raise `UnknownModel` unless `name` can name a model (see the module docstring)."""
    if not name.strip():
        raise UnknownModel(
            "no model given: set CBQ_MODEL or pass --model: a checkpoint folder, a hub id (org/name) or a preset "
            f"({', '.join(presets)})"
        )
    if name in presets or os.path.isdir(name) or (name.lower().endswith(".gguf") and os.path.isfile(name)):
        return  # a GGUF file exists: the loader refuses it in its own line
    parent = os.path.dirname(name.rstrip("/"))
    is_path = name.startswith((".", "/", "~")) or (parent != "" and os.path.isdir(parent))
    if is_path:
        folder = parent or "."
        siblings = [os.path.join(parent, e) for e in _folders(folder)] if os.path.isdir(folder) else []
        raise UnknownModel(f"no such checkpoint folder: {name}{_did_you_mean(name, siblings)}")
    if HUB_ID.match(name) or _in_hub_cache(name):
        return
    local = [e for e in _folders(".") if os.path.exists(os.path.join(e, "config.json"))]
    raise UnknownModel(
        f"unknown model {name!r}: not a preset ({', '.join(presets)}), a local folder or a hub id (org/name)"
        + _did_you_mean(name, presets + local)
    )


def _folders(path: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _in_hub_cache(name: str) -> bool:
    """Whether a bare hub name (e.g. `gpt2`) has a config in the local Hugging Face cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # an id the hub client rejects
        return False
