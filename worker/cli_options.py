"""The engine's command-line flags, shared by `cbq worker`, `cbq run` and `cbq bench engine`. Owns each
engine flag's name (vLLM's where vLLM has one), its help text and the `EngineConfig` field it sets.

Nothing here imports torch: `cbq --help` imports this module.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from worker.engine.config import DECODERS, KV_CACHE_DTYPES, MODES, QUANTIZATIONS, EngineConfig

MODEL_ENV = "CBQ_MODEL"
DEFAULT_MODEL = "tiny-llama"
ENGINE_DEFAULTS = EngineConfig()  # help texts show these; flags left unset keep them
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings


@dataclass(frozen=True)
class ConfigFlag:
    """One click option that sets one `EngineConfig` field when given (None: not given)."""

    decls: tuple[
        str, ...
    ]  # click's names, e.g. ("--num-kv-blocks", "--num-gpu-blocks-override", "num_kv_blocks")
    config_field: str
    attrs: dict[str, Any] = field(default_factory=dict)  # click.option keyword arguments
    to_config: Callable[[Any], Any] = lambda value: value  # the flag's value -> the field's (None: unset)

    @property
    def param_name(self) -> str:
        return next((d for d in self.decls if not d.startswith("-")), self.config_field)


def config_flags(*flags: ConfigFlag) -> Callable:
    """A decorator adding `flags`; the command receives the given ones as one `engine_config` dict
    (field -> value). Stacked decorators merge into the same dict."""

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            given = [(flag.config_field, flag.to_config(kwargs.pop(flag.param_name))) for flag in flags]
            config = {**kwargs.pop("engine_config", {}), **{k: v for k, v in given if v is not None}}
            return f(*args, engine_config=config, **kwargs)

        for flag in reversed(flags):
            wrapper = click.option(*flag.decls, **{"default": None, **flag.attrs})(wrapper)
        return wrapper

    return decorate


# GPU memory and context: vLLM's flag names, so a vLLM command line carries over.
GPU_MEMORY_FLAGS = (
    ConfigFlag(
        ("--gpu-memory-utilization", "gpu_memory_utilization"),
        "gpu_memory_utilization",
        {
            "type": click.FloatRange(0, 1, min_open=True),
            "help": "Fraction of the GPU's total memory this engine may use: weights, activations and KV cache "
            f"(default {ENGINE_DEFAULTS.gpu_memory_utilization}). The KV cache gets what is left after the "
            "model loads; memory other processes hold counts against it.",
        },
    ),
    ConfigFlag(
        ("--max-model-len", "max_model_len"),
        "max_model_len",
        {
            "type": click.IntRange(min=2),
            "help": "Context length in tokens, prompt and output together (default: the model's "
            "max_position_embeddings, capped by what the KV cache holds).",
        },
    ),
    ConfigFlag(
        ("--num-kv-blocks", "--num-gpu-blocks-override", "num_kv_blocks"),
        "num_kv_blocks",
        {
            "type": click.IntRange(min=2),
            "help": f"KV cache size in blocks of {ENGINE_DEFAULTS.block_size} tokens, instead of sizing it "
            "from memory.",
        },
    ),
)
gpu_memory_options = config_flags(*GPU_MEMORY_FLAGS)

# How weights and KV are stored: vLLM's flag names and values.
QUANTIZATION_FLAGS = (
    ConfigFlag(
        ("--quantization", "quantization"),
        "quantization",
        {
            "type": click.Choice(QUANTIZATIONS),
            "help": "fp8: quantize an unquantized checkpoint's linears at load (FP8 weights per output channel, "
            "activations per token; FP8 GEMMs on sm89+ GPUs, the dequantized weights elsewhere; a mixture of "
            "experts' routed experts too, on sm89+ GPUs). FP8 checkpoints "
            "(block-wise fp8, compressed-tensors, fbgemm_fp8) run in their own format without it.",
        },
    ),
    ConfigFlag(
        ("--kv-cache-dtype", "kv_cache_dtype"),
        "kv_cache_dtype",
        {
            "type": click.Choice(KV_CACHE_DTYPES),
            "help": "KV cache dtype (default auto: the model dtype). fp8: e4m3 with per-layer scales (1.0, or the "
            "checkpoint's k_scale/v_scale; a latent cache's k_scale), half bf16's bytes, so twice the blocks; sm89+ "
            "GPUs and the CPU.",
        },
    ),
)
quantization_options = config_flags(*QUANTIZATION_FLAGS)

DETERMINISTIC_FLAG = ConfigFlag(
    ("--deterministic", "deterministic"),
    "deterministic",
    {
        "is_flag": True,
        "default": False,
        "help": "Batch-invariant kernels: a request's tokens are bitwise the same alone or in any batch, sync or "
        "async, with any --max-num-batched-tokens, prefix cache on or off (slower; docs/operations.md). "
        "bench engine: runs every setup in deterministic and in default mode.",
    },
    to_config=lambda on: True if on else None,
)
deterministic_option = config_flags(DETERMINISTIC_FLAG)

TENSOR_PARALLEL_FLAG = ConfigFlag(
    ("--tensor-parallel-size", "-tp", "tensor_parallel_size"),
    "tensor_parallel_size",
    {
        "type": click.IntRange(min=1),
        "help": "GPUs of this host one model is split over (default 1), for a model too big for one GPU: the "
        "worker starts one process per extra GPU. More throughput from a model that fits one GPU comes from "
        "more workers instead (docs/operations.md).",
    },
)
tensor_parallel_option = config_flags(TENSOR_PARALLEL_FLAG)

engine_tuning_options = config_flags(
    ConfigFlag(
        ("--max-num-seqs", "max_num_seqs"),
        "max_num_seqs",
        {
            "type": click.IntRange(min=1),
            "help": f"Running requests at most (default {ENGINE_DEFAULTS.max_num_seqs}).",
        },
    ),
    ConfigFlag(
        ("--max-num-batched-tokens", "max_num_batched_tokens"),
        "max_num_batched_tokens",
        {
            "type": click.IntRange(min=1),
            "help": f"Token budget per engine step (default {ENGINE_DEFAULTS.max_num_batched_tokens}).",
        },
    ),
    ConfigFlag(
        ("--dtype", "dtype"),
        "dtype",
        {
            "type": click.Choice(["auto", "bfloat16", "float16", "float32", *DTYPE_ALIASES]),
            "help": f"Model dtype (default: {ENGINE_DEFAULTS.dtype}, i.e. bfloat16 on CUDA, float32 on CPU); "
            "half and float are vLLM's spellings of float16 and float32.",
        },
        to_config=lambda dtype: DTYPE_ALIASES.get(dtype, dtype),
    ),
    *GPU_MEMORY_FLAGS,
    *QUANTIZATION_FLAGS,
    ConfigFlag(
        ("--generation-config-defaults/--no-generation-config-defaults", "generation_config_defaults"),
        "generation_config_defaults",
        {
            "help": "Sampling fields a request leaves unset (temperature, top_p, top_k, max tokens) take the "
            "checkpoint's generation_config.json values (default), or cbq's built-in ones (greedy, the rest "
            "of the context). Its eos tokens apply either way.",
        },
    ),
    ConfigFlag(
        ("--enable-prefix-caching/--no-enable-prefix-caching", "enable_prefix_caching"),
        "enable_prefix_caching",
        {
            "help": "Reuse the KV blocks of shared prompt prefixes (default), or compute every prompt whole "
            "(vLLM's names; --no-prefix-caching is the same as the second).",
        },
    ),
    ConfigFlag(
        ("--no-prefix-caching", "no_prefix_caching"),
        "enable_prefix_caching",
        {"is_flag": True, "default": False, "hidden": True},
        to_config=lambda no_caching: False if no_caching else None,
    ),
    ConfigFlag(
        ("--enforce-eager", "enforce_eager"),
        "use_cuda_graphs",
        {
            "is_flag": True,
            "default": False,
            "help": "Run decode steps eagerly instead of replaying CUDA graphs (as vLLM's; no effect on the CPU).",
        },
        to_config=lambda eager: False if eager else None,
    ),
    ConfigFlag(
        ("--decoder", "decoder"),
        "decoder",
        {
            "type": click.Choice(DECODERS),
            "help": "What runs the model's layers (default auto: cbq's owned decoder on CUDA where it runs the "
            "family, transformers' layers with cbq's attention elsewhere); either runs a vision-language model's "
            "images (Gemma 3 4B-27B: their text alone under --deterministic or --quantization). An embedding model "
            "runs packed under auto on every device (a decoder through the owned decoder, a BERT or XLM-RoBERTa "
            "encoder through transformers' modules); hf: transformers' padded forward.",
        },
    ),
    DETERMINISTIC_FLAG,
    TENSOR_PARALLEL_FLAG,
)


def served_model_name(model: str, given: str | None = None) -> str:
    """The model name a worker serves (vLLM's --served-model-name): `given`, else the checkpoint folder's name
    for a local path, else the preset or hub name as given (the fake engine stands in for --model too)."""
    if given:
        return given
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


def engine_options(f: Callable) -> Callable:
    """--model, --mode, --device, --fake-engine, --served-model-name, --chat-template and the tuning flags
    (`engine_config`; the chat template's text rides in it as `chat_template`, which `build_engine` takes out)."""
    f = engine_tuning_options(f)
    f = config_flags(
        ConfigFlag(
            ("--chat-template", "chat_template"),
            "chat_template",
            {
                "metavar": "FILE-OR-TEMPLATE",
                "callback": _chat_template_text,
                "help": "A Jinja chat template, used instead of the tokenizer's (needed for chat lines when "
                "the checkpoint has none: they fail otherwise): a file, or as in vLLM the template itself.",
            },
        )
    )(f)
    f = click.option(
        "--served-model-name",
        "served_model_name_",
        multiple=True,
        callback=_one_served_name,
        help="The model name this worker serves (default: the checkpoint folder's name, or the preset or hub "
        "name). Batches whose lines name a model go to that model's queue; outputs carry this name. One name: "
        "given twice, it is refused.",
    )(f)
    f = _vllm_model_flags(f)
    f = click.option(
        "--fake-engine",
        is_flag=True,
        help="Use the instant echo engine (no model, no torch), to try the queue.",
    )(f)
    f = click.option(
        "--device",
        default=None,
        help=f"Engine device, e.g. cuda:0 or cpu (default: {ENGINE_DEFAULTS.device}, CUDA when there is one).",
    )(f)
    f = click.option(
        "--mode",
        type=click.Choice(MODES),
        default=ENGINE_DEFAULTS.mode,
        show_default=True,
        help="Engine step loop: async overlaps CPU batch preparation with GPU compute.",
    )(f)
    f = click.option(
        "--model",
        envvar=MODEL_ENV,
        is_eager=True,  # processed first: --tokenizer compares with it
        default=DEFAULT_MODEL,
        show_default=True,
        help=f"Engine preset name, local checkpoint folder or hub id (org/name). Env: {MODEL_ENV}.",
    )(f)
    return f


def _chat_template_text(_ctx, _param, value: str | None) -> str | None:
    """--chat-template's text: the file it names, else (as vLLM takes it) the value itself when it reads as a
    Jinja template."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"cannot read {value}: {exc}") from None
    if any(mark in value for mark in "{}\n"):  # as vLLM tells a template given inline from a path
        return value
    raise click.BadParameter(f"{value!r} is neither a file nor a Jinja template ({{{{ ... }}}} or {{% ... %}})")


def _one_served_name(_ctx, _param, names: tuple[str, ...]) -> str | None:
    distinct = list(dict.fromkeys(names))
    if len(distinct) > 1:
        raise click.BadParameter(
            f"given {len(distinct)} names ({', '.join(distinct)}): a worker serves one model name; start one "
            "worker per name",
        )
    return distinct[0] if distinct else None


def _same_as_model(flag: str):
    """A vLLM flag cbq takes only at vLLM's default, the model itself (cbq loads the checkpoint's own)."""

    def check(ctx: click.Context, _param, value: str | None) -> None:
        model = ctx.params.get("model")
        if value is None or model is None or value == model:
            return
        if os.path.isdir(value) and os.path.isdir(model) and os.path.samefile(value, model):
            return
        raise click.ClickException(
            f"{flag} {value}: cbq loads the tokenizer of --model ({model}); a different one is not supported: put "
            "its files in a copy of the checkpoint folder and pass that as --model"
        )

    return check


def _revision(_ctx, _param, value: str | None) -> None:
    if value not in (None, "main"):
        raise click.ClickException(
            f"--revision {value}: cbq loads a hub model's main revision; to run {value!r}, download it first "
            f"(huggingface-cli download NAME --revision {value} --local-dir DIR) and pass --model DIR"
        )


def _refuse_remote_code(_ctx, _param, value: bool) -> None:
    if value:
        from worker.engine.families.registry import MODULES  # only here: it imports torch

        raise click.ClickException(
            "--trust-remote-code: cbq never runs a checkpoint's own code; it runs its own implementation of "
            f"these model types: {', '.join(sorted(MODULES))}"
        )


def _vllm_model_flags(f: Callable) -> Callable:
    """vLLM's model-loading flags, taken where they mean the same in cbq and refused in one line where not."""
    f = click.option(
        "--trust-remote-code",
        is_flag=True,
        expose_value=False,
        callback=_refuse_remote_code,
        help="Refused: cbq runs its own implementation of each supported family, never a checkpoint's code.",
    )(f)
    f = click.option(
        "--revision",
        expose_value=False,
        callback=_revision,
        help="vLLM's hub revision: only main (the default); for another, download it and pass the folder.",
    )(f)
    f = click.option(
        "--tokenizer",
        expose_value=False,
        callback=_same_as_model("--tokenizer"),
        help="vLLM's tokenizer flag: accepted when it names the model itself (cbq loads the checkpoint's).",
    )(f)
    return f


def output_parser_options(f: Callable) -> Callable:
    """--tool-call-parser and --reasoning-parser (vLLM's names): how chat outputs are split into content,
    reasoning and tool calls (worker/output_parsers)."""
    from worker.output_parsers import PARSER_CHOICES

    f = click.option(
        "--reasoning-parser",
        type=click.Choice(PARSER_CHOICES["reasoning_parser"]),
        default="auto",
        show_default=True,
        help="Separate a chat answer's reasoning into reasoning_content: think (<think>...</think>: Qwen3, "
        "DeepSeek-R1 distills), harmony (gpt-oss's analysis channel); auto picks from the chat template, none "
        "leaves it in the content. A response_format or forced tool call then constrains only what follows it.",
    )(f)
    f = click.option(
        "--tool-call-parser",
        type=click.Choice(PARSER_CHOICES["tool_call_parser"]),
        default="auto",
        show_default=True,
        help='The model\'s tool-call format, parsed into tool_calls when a chat request lets it call tools '
        '(tool_choice "auto"): hermes (<tool_call>: Hermes, Qwen2.5, Qwen3), llama3_json, mistral '
        "([TOOL_CALLS]), harmony (gpt-oss); auto picks from the chat template, none leaves calls in the content.",
    )(f)
    return f


def _image_limit(value: str | None) -> int | None:
    """vLLM's --limit-mm-per-prompt JSON ({"image": N}); only images are taken."""
    if value is None:
        return None
    try:
        limits = json.loads(value)
    except ValueError:
        raise click.BadParameter('a JSON object such as {"image": 4}') from None
    if not isinstance(limits, dict) or set(limits) - {"image"} or not isinstance(limits.get("image", 0), int):
        raise click.BadParameter('only {"image": N} is taken: cbq reads no audio or video')
    return limits.get("image")


def media_options(f: Callable) -> Callable:
    """The flags of `MediaPolicy` (worker/media/): where a chat's images may be read from, and their limits.
    The command receives them as one `media_policy` keyword."""
    from worker.media.policy import (
        DEFAULT_FETCH_TIMEOUT_SECONDS,
        DEFAULT_MAX_IMAGE_BYTES,
        DEFAULT_MAX_IMAGE_PIXELS,
        MediaPolicy,
    )

    names = ("allowed_local_media_path", "allowed_media_domains", "limit_mm_per_prompt", "max_image_bytes",
             "max_image_pixels", "media_fetch_timeout")  # fmt: skip

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in names}
        domains = frozenset(d for entry in given["allowed_media_domains"] for d in entry.split(",") if d.strip())
        fields = {
            "allowed_local_media_path": given["allowed_local_media_path"],
            "allowed_media_domains": domains,
            "max_images_per_request": _image_limit(given["limit_mm_per_prompt"]),
            "max_image_bytes": given["max_image_bytes"],
            "max_image_pixels": given["max_image_pixels"],
            "fetch_timeout_seconds": given["media_fetch_timeout"],
        }
        try:
            policy = MediaPolicy(**{k: v for k, v in fields.items() if v is not None})
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        return f(*args, media_policy=policy, **kwargs)

    options = [
        click.option(
            "--allowed-local-media-path",
            type=click.Path(exists=True, file_okay=False),
            default=None,
            help="A directory whose files chat lines may name as images (file:///path URLs): only files whose "
            "real path, symlinks resolved, lies under it. Default: no local files.",
        ),
        click.option(
            "--allowed-media-domains",
            multiple=True,
            help="A host name (repeat the flag, or separate by commas) whose http(s) image URLs the worker "
            "fetches; redirects are followed only to listed hosts; IP addresses are never fetched. Default: "
            "none (data: URLs only).",
        ),
        click.option(
            "--limit-mm-per-prompt",
            default=None,
            help=f'Images per request at most, as vLLM writes it: {{"image": N}} (default and most: '
            f"{MediaPolicy().max_images_per_request}).",
        ),
        click.option(
            "--max-image-bytes",
            type=click.IntRange(min=1),
            default=None,
            help=f"Bytes of one image at most, encoded (default {DEFAULT_MAX_IMAGE_BYTES}).",
        ),
        click.option(
            "--max-image-pixels",
            type=click.IntRange(min=1),
            default=None,
            help=f"Pixels of one image at most, width x height, checked before decoding (default "
            f"{DEFAULT_MAX_IMAGE_PIXELS}).",
        ),
        click.option(
            "--media-fetch-timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help=f"Seconds one image's http(s) fetch may take, redirects included (default "
            f"{DEFAULT_FETCH_TIMEOUT_SECONDS:g}).",
        ),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper
