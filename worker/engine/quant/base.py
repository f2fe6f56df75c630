"""What every weight format's typed config answers, and the module-name rules the formats share. Owns nothing.

  QuantConfig        the base of every format's description (FP8's in config.py, INT4's in int4/): its
                     `quant_method`, whether the checkpoint holds the quantized tensors (`is_serialized`), and
                     `scheme_for(module_name)`: how that linear is quantized, or None where it stays dense
  FormatRefused      a format module's refusal, saying only what is refused; config.py turns it into the one
                     line `UnsupportedQuantization` that names what cbq runs
  QuantCheckpointError  a checkpoint's tensors disagree with its quantization_config (the message names the tensor)
  stays_dense        transformers' `modules_to_not_convert` rule, and the output head, which no release quantizes
  ct_matches         compressed-tensors' `targets` / `ignore` rule

It sits below config.py and the format modules so that both read it without importing each other.
"""

from __future__ import annotations

import re
from typing import Any

FIELD = "config.json quantization_config"


class QuantConfig:
    """Base of the per-format descriptions: which scheme each linear module runs."""

    quant_method: str = ""
    is_serialized: bool = True  # the checkpoint holds quantized weights (False: quantized at load)

    def scheme_for(self, module_name: str) -> Any:
        """The scheme linear `module_name` runs, or None where it stays in the compute dtype."""
        raise NotImplementedError


class FormatRefused(ValueError):
    """What a format module refuses (e.g. "config.json quantization_config.bits 8"); config.py adds what cbq runs."""


class QuantCheckpointError(ValueError):
    """A checkpoint's tensors do not match its quantization_config; the message names the tensor."""


def stays_dense(module_name: str, modules_to_not_convert: tuple[str, ...]) -> bool:
    """The output head never is quantized; else transformers' `modules_to_not_convert` rule: a listed name
    matches the module or any module under it, and a bare name ("gate") matches wherever it sits."""
    if module_name.endswith("lm_head"):
        return True
    names, parts = modules_to_not_convert, module_name.split(".")
    for name in names:
        n = len(name.split("."))
        if any(".".join(parts[i : i + n]) == name for i in range(len(parts) - n + 1)):
            return True
    return False


def ct_matches(module_name: str, target: str) -> bool:
    """compressed-tensors' matching: a class name ("Linear": every linear this is asked about), a "re:" regex matched
    from the start of the name, or the name itself."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module_name) is not None
    return module_name == target


def module_list(value: Any, field: str) -> tuple[str, ...]:
    """A config's list of module names (`ignore`, `modules_to_not_convert`); None is empty."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise FormatRefused(f"{field}: a module list of {value!r} (a list of names expected)")
    return tuple(value)
