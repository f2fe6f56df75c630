"""Per-kernel device time per engine step, under torch.profiler, for the benchmarks README.

    python3 benchmarks/profile_step.py --workload w1 --decoder owned [--decoder hf]
        [--decode-gemm triton --decode-gemm cublas] [--determinism default --determinism deterministic]
        [--precision bf16 --precision fp8] [--out FILE]

w1: 32 requests, prompt 256, 256 new tokens, 32 seqs / 2048 tokens per step (decode steps, graphs).
w2: 400 W2 requests with outputs capped at 120 tokens, 1024 seqs / 8192 tokens (prefill-heavy mixed steps).
Random-weight Llama-3-8B shape in bf16 (`--model`: another preset, e.g. deepseek-v2-lite), async mode; `--precision` as `bench engine`'s (fp8: FP8 weights and KV),
each precision's model loaded and freed in turn. Needs only torch, transformers and triton.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from worker.bench.common import make_workload, warmup_requests  # noqa: E402
from worker.bench.engine import PRECISIONS  # noqa: E402
from worker.engine.api import EngineRequest, SamplingParams  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.engine.models import load_model  # noqa: E402

# max_model_len as `bench engine --max-model-len 8192` runs the long-context shapes (DeepSeek-V2-Lite: 163,840)
WORKLOADS = {
    "w1": dict(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=8192),
    "w2": dict(max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=8192),
}


def requests_for(workload: str) -> list[EngineRequest]:
    if workload == "w1":
        return [
            EngineRequest(
                f"p{i}", [(7 * i + j) % 32000 for j in range(256)], SamplingParams(256, ignore_eos=True)
            )
            for i in range(32)
        ]
    reqs = make_workload("W2", 32000, num_requests=400)
    return [
        EngineRequest(
            r.request_id, r.prompt_ids, SamplingParams(min(r.sampling.max_new_tokens, 120), ignore_eos=True)
        )
        for r in reqs
    ]


def kernel_table(prof, num_steps: int, top: int) -> list[str]:
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_name[evt.name]
            entry[0] += evt.time_range.elapsed_us() / 1000.0
            entry[1] += 1
    total = sum(ms for ms, _ in per_name.values())
    lines = [f"total device time {total:.1f} ms; per step {total / num_steps:.3f} ms"]
    for name, (ms, calls) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(
            f"{ms:9.1f} ms {100 * ms / total:5.1f}% calls {calls:7d} per-step {ms / num_steps:7.3f} ms  {name[:110]}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="w1")
    parser.add_argument("--decoder", action="append", choices=["owned", "hf"])
    parser.add_argument("--decode-gemm", action="append", choices=["auto", "triton", "cublas"])
    parser.add_argument("--determinism", action="append", choices=["default", "deterministic"])
    parser.add_argument("--precision", action="append", choices=list(PRECISIONS))
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out_lines = []
    setups = [
        (p, d, g, det)
        for p in args.precision or ["bf16"]
        for d in args.decoder or ["owned"]
        for g in args.decode_gemm or ["auto"]
        for det in args.determinism or ["default"]
    ]
    model = tok = loaded = None
    for precision, decoder, gemm, determinism in setups:
        settings = PRECISIONS[precision]
        if loaded != precision:  # one precision's model in memory at a time
            model = tok = None
            torch.cuda.empty_cache()
            model, tok = load_model(
                args.model, torch.device("cuda"), torch.bfloat16, quantization=settings["quantization"]
            )
            loaded = precision
        config = EngineConfig(
            mode="async", decoder=decoder, decode_gemm=gemm, deterministic=determinism == "deterministic",
            quantization=settings["quantization"], kv_cache_dtype=settings["kv_cache_dtype"] or "auto",
            **WORKLOADS[args.workload],
        )  # fmt: skip
        engine = Engine(model, tok, config)
        reqs = requests_for(args.workload)
        engine.generate(warmup_requests(reqs, 32000))
        engine.reset_stats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.generate(reqs)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        stats = engine.stats()
        out_lines.append(
            f"{args.workload} {precision} decoder={decoder} decode_gemm={gemm} {determinism} wall {wall:.2f}s steps {stats.steps} "
            f"output_tokens {stats.output_tokens} busy {stats.busy_seconds:.2f}s"
        )
        out_lines += kernel_table(prof, max(stats.steps, 1), args.top)
        del engine
        torch.cuda.empty_cache()
    text = "\n".join(out_lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
