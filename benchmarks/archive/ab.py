"""In-process engine A/B runs on the GPU: the model loaded once, one engine per variant, each built while its
module attributes are swapped (so its CUDA graphs capture the swapped kernels), rounds alternated in one process.

Used by benchmarks/w1_attention_ab.py and benchmarks/w2_prefill_ab.py. Comparing runs across processes or machines
is not meaningful here: calls drift by 1-4% (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

Patches = Mapping[str, Any]  # module attribute name -> the object it holds while a variant runs


def variant_parser(description: str, variants: Mapping[str, Patches]) -> argparse.ArgumentParser:
    """The scripts' common arguments: variant names (default: all, then "landed" again) and --rounds."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help=f"of {', '.join(variants)} (default: all, then landed again)")
    parser.add_argument("--rounds", type=int, default=1)
    return parser


def chosen_variants(parser: argparse.ArgumentParser, args: argparse.Namespace, variants: Mapping[str, Patches]):
    unknown = sorted(set(args.variants) - set(variants))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(variants)}")
    return args.variants or [*variants, "landed"]


@contextlib.contextmanager
def patched(module: ModuleType, patches: Patches) -> Iterator[None]:
    """Swap `module`'s attributes for the block, restoring them even if it raises."""
    saved = {name: getattr(module, name) for name in patches}
    try:
        for name, value in patches.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def run_engine_ab(
    module: ModuleType,
    variants: Mapping[str, Patches],
    names: list[str],
    rounds: int,
    workload: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> None:
    """Llama-3-8B shape in bf16, `workload` in async mode, once per variant and round; prints a line per run."""
    import torch

    from worker.bench.common import make_workload, warmup_requests
    from worker.bench.engine import measure_copy_bandwidth, run_engine_mode
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.models import load_model

    device = torch.device("cuda")
    model, tokenizer = load_model("llama3-8b", device, torch.bfloat16)
    bandwidth = measure_copy_bandwidth(device)
    vocab_limit = min(model.config.vocab_size, 32000)
    reqs = make_workload(workload, vocab_limit)
    warmup = warmup_requests(reqs, vocab_limit)
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; {workload} async, "
        f"max_num_seqs {max_num_seqs}",
        flush=True,
    )
    width = max(map(len, names))
    first = True
    for round_index in range(rounds):
        for name in names:
            with patched(module, variants[name]):
                config = EngineConfig(mode="async", device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
                engine = Engine(model, tokenizer, config)
                engine.generate(warmup)
                if first:  # a process's first run is slow on the device (benchmarks/README.md): absorb it
                    engine.generate(warmup_requests(reqs, vocab_limit, full_length=True))
                    first = False
                res = run_engine_mode(engine, reqs, name, bandwidth)
                print(
                    f"round {round_index} {name:{width}s} {res.output_tok_s:7,.0f} tok/s  {res.gpu_ms:.3f} GPU ms/step  "
                    f"busy {res.gpu_busy:.3f}  compiles {len(res.extra['triton_compiles'])}",
                    flush=True,
                )
                del engine
                torch.cuda.empty_cache()
