"""What `bench engine` reports: one `ModeResult` per run, the printed table, the ratios between runs of one call
(async/sync, deterministic/default, fp8/bf16, variant/plain, model/first model).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import click


@dataclass
class ModeResult:
    mode: str
    output_tokens: int
    wall_seconds: float
    output_tok_s: float
    total_tok_s: float
    steps: int = 0
    step_ms: float = 0.0  # wall time per step
    gpu_ms: float = 0.0  # device time per step (CUDA events on the compute stream)
    cpu_prep_ms: float = 0.0  # scheduling + batch building per step
    mask_ms: float = 0.0  # host time computing constraint masks per step (overlaps the forward in async)
    gpu_busy: float = 0.0  # device time / wall time
    floor_seconds: float = 0.0  # sum over steps of max(bytes / bandwidth, flops / peak)
    floor_ratio: float = 0.0  # floor_seconds / wall_seconds: 1.0 would be at the floor
    floor_tok_s: float = 0.0
    serial_floor_ratio: float = 0.0  # the same with GEMMs and KV reads back to back (floor_seconds' `serial`)
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / looked up
    extra: dict = field(default_factory=dict)


def tokens_digest(results) -> str:
    """A hash of every request's tokens in request order: two runs of the same requests agree on every token
    iff their digests are equal (sync vs async in deterministic mode)."""
    digest = hashlib.sha256()
    for r in sorted(results, key=lambda r: r.request_id):
        for sample in r.all_samples:
            digest.update(f"{r.request_id}:{sample.token_ids}\n".encode())
    return digest.hexdigest()[:16]


def slowest_steps(step_log, count: int = 3) -> list[dict]:
    """The steps with the most device time (a stall inside one shows here first)."""
    top = sorted(step_log, key=lambda step: -step[3])[:count]
    return [
        {"tokens": tokens, "seqs": seqs, "context_tokens": context, "device_ms": 1000 * device}
        for tokens, seqs, context, device in top
    ]


def print_table(workload: str, model_name: str, results: list[ModeResult]) -> None:
    cols = [
        "mode",
        "out tok/s",
        "total tok/s",
        "steps",
        "step ms",
        "gpu ms",
        "prep ms",
        "mask ms",
        "busy",
        "floor tok/s",
        "floor ratio",
        "serial ratio",
        "preempt",
        "cache hits",
    ]
    click.echo(f"\n{workload} on {model_name}")
    click.echo(" | ".join(f"{c:>11}" for c in cols))
    for r in results:
        row = [
            r.mode,
            f"{r.output_tok_s:,.0f}",
            f"{r.total_tok_s:,.0f}",
            r.steps,
            f"{r.step_ms:.2f}",
            f"{r.gpu_ms:.2f}",
            f"{r.cpu_prep_ms:.3f}",
            f"{r.mask_ms:.3f}",
            f"{r.gpu_busy:.1%}",
            f"{r.floor_tok_s:,.0f}",
            f"{r.floor_ratio:.2f}",
            f"{r.serial_floor_ratio:.2f}",
            r.num_preemptions,
            f"{r.prefix_cache_hit_rate:.1%}",
        ]
        click.echo(" | ".join(f"{str(v):>11}" for v in row))


def print_ratios(
    results: list[ModeResult], suffixes: list[str], models: list[str], many_determinisms: bool, many_precisions: bool
) -> None:
    """The ratios between the runs of one call: async/sync (and whether their tokens agree) for each setup
    `suffixes` names, deterministic/default, each precision/bf16, each variant/plain, each model's floor ratio
    against the first model's."""
    by_mode = {r.mode: r for r in results}
    for suffix in suffixes:
        if f"sync{suffix}" in by_mode and f"async{suffix}" in by_mode:
            ratio = by_mode[f"async{suffix}"].output_tok_s / by_mode[f"sync{suffix}"].output_tok_s
            click.echo(f"async/sync output tok/s{suffix}: {ratio:.3f}")
            same = by_mode[f"async{suffix}"].extra["tokens_digest"] == by_mode[f"sync{suffix}"].extra["tokens_digest"]
            click.echo(f"async and sync tokens{suffix}: {'identical' if same else 'differ'}")
    if many_determinisms:
        for r in results:
            other = by_mode.get(r.mode.replace("-deterministic", "-default"))
            if "-deterministic" in r.mode and other is not None:
                click.echo(f"{r.mode} / {other.mode} output tok/s: {r.output_tok_s / other.output_tok_s:.3f}")
    if many_precisions:
        for r in results:
            precision = r.extra.get("precision")
            other = by_mode.get(r.mode.replace(f"-{precision}", "-bf16"))
            if precision not in (None, "bf16") and other is not None:
                click.echo(f"{r.mode} / {other.mode} output tok/s: {r.output_tok_s / other.output_tok_s:.3f}")
    for r in results:  # --mla-prefill repeated: each prefill choice against the absorbed one
        prefill = r.extra.get("mla_prefill")
        other = by_mode.get(r.mode.replace(f"-{prefill}", "-absorbed")) if prefill not in (None, "absorbed") else None
        if other is not None and other is not r:
            click.echo(f"{r.mode} / {other.mode} output tok/s: {r.output_tok_s / other.output_tok_s:.3f}")
    plain = [r for r in results if r.extra.get("variant") == "plain"]
    for r in results:
        if "variant" not in r.extra:  # transformers' run
            continue
        base = next((p for p in plain if r.mode.replace(r.extra["variant"], "plain") == p.mode), None)
        if base is not None and r is not base:
            click.echo(f"{r.mode} / {base.mode} output tok/s: {r.output_tok_s / base.output_tok_s:.3f}")
    if len(models) > 1:  # each model's floor ratio against the first's, run by run (issue 24: within 10%)
        for r in results:
            first = by_mode.get(r.mode.replace(r.extra.get("model", ""), models[0]))
            if first is not None and r is not first and r.extra.get("model") and first.floor_ratio:
                click.echo(f"{r.mode} floor ratio / {first.mode}'s: {r.floor_ratio / first.floor_ratio:.3f}")
