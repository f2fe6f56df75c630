"""`cbq bench quality`: what FP8 costs in accuracy, on a real-shaped random model (issue 26, item 7).

One random model (the `--model` preset's shape, Llama-3-8B by default; `--num-layers` keeps it quick) runs the
same prompts teacher-forced in four setups, through cbq's own forward (the runner's decoder, paged KV cache and
attention kernels, as the engine runs them):

  reference       the model dtype (bf16 on CUDA, fp32 on the CPU), cache in the model dtype
  fp8_kv          the same weights, `--kv-cache-dtype fp8`
  fp8_weights     `--quantization fp8` (FP8 weights per output channel, activations per token)
  fp8_weights_kv  both

Each prompt's first `prompt_len - decode_len` tokens run as one prefill step, the last `decode_len` tokens as
single-token decode steps, so both the prefill and the decode attention read the cache. For every position it
compares the setup's next-token distribution with the reference's: KL(reference || setup) in nats, and whether
the top-1 token agrees; the table gives their means over every position of every prompt, and the JSON every
number. The reference's mean entropy and top-1 probability say how peaked the logits are.

The random model's init (`--init scaled`, the default) is the preset's normal(0.02) with two changes, so that
its residual stream and logits are shaped like a trained model's. (1) Unit-variance embeddings, and each residual
projection (o_proj, down_proj) scaled so its output's RMS on the first prompt is 1 / sqrt(2 x layers) (GPT-2's
rule): each block then adds a small update to the residual stream, as trained blocks do. At the plain init each
block adds ~100x the embedding's magnitude, every block's FP8 error (W8A8: ~5% of a GEMM's output) lands in
the stream at full size, and on the H200, 8 layers of the Llama-3-8B shape gave FP8 weights a mean KL of 0.88
and 37% top-1 agreement. (2) The output head scaled until the reference's logits have a standard deviation of
`--logit-std` (default 4, about what trained models show): 0.02 gives near-flat logits over a 128k
vocabulary, where any change flips near-ties. Both apply to every setup alike (the head is not quantized).
`--init plain` keeps the preset's init (only the head is scaled). NOTE: a random model is a proxy: the numbers
follow the init (a trained checkpoint's own numbers are the ones to quote); they compare setups and catch
regressions.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import time
from dataclasses import asdict, dataclass

import click

SETUPS = {  # name: (FP8 weights, FP8 KV cache)
    "reference": (False, False),
    "fp8_kv": (False, True),
    "fp8_weights": (True, False),
    "fp8_weights_kv": (True, True),
}


@dataclass
class SetupQuality:
    mean_kl: float  # nats, KL(reference || setup) averaged over positions
    max_kl: float
    top1_agreement: float  # fraction of positions whose argmax token is the reference's
    positions: int


def build_models(
    preset: str, num_layers: int | None, dtype, device, seed: int, logit_std: float, probe, init: str = "scaled"
):
    """(reference model, FP8-weight copy): the preset's architecture with random weights (seeded), at the
    `init` the module docstring describes, its output head scaled so the reference's logits on `probe` (token
    ids) have std `logit_std` (0: unscaled)."""
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.models.loader import preset_config
    from worker.engine.quant import Fp8Config, checkpoint_quantization
    from worker.engine.quant.linear import quantize_linears

    config = preset_config(preset)
    if num_layers:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:num_layers]
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    with torch.inference_mode():
        if init == "scaled":
            gen = torch.Generator(device=device).manual_seed(seed + 1)
            embed = model.get_input_embeddings().weight
            embed.copy_(torch.randn(embed.shape, generator=gen, device=device, dtype=torch.float32))
            _scale_residual_projections(model, probe.to(device), (2 * config.num_hidden_layers) ** -0.5)
        if logit_std > 0:
            std = float(model(input_ids=probe[None].to(device)).logits.float().std())
            model.get_output_embeddings().weight.mul_(logit_std / std)
        fp8 = copy.deepcopy(model)
        quant = checkpoint_quantization(None, requested="fp8")
        assert isinstance(quant, Fp8Config), "--quantization fp8 is an FP8 config"
        quantize_linears(fp8, quant, keep_fp8=True)  # the FP8 GEMM on sm89+, its emulation elsewhere
    return model, fp8


def _scale_residual_projections(model, probe, target_rms: float) -> None:
    """Scale every o_proj and down_proj weight so its output on `probe` has RMS `target_rms`. One forward
    measures them all: each block's input is RMS-normed, so its output scale hardly depends on the others'."""
    rms: dict[str, float] = {}
    modules = {n: m for n, m in model.named_modules() if n.endswith(("o_proj", "down_proj"))}

    def hook(name):
        def record(_module, _inputs, output):
            rms[name] = float(output.float().pow(2).mean().sqrt())

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        model(input_ids=probe[None])
    finally:
        for handle in handles:
            handle.remove()
    for name, module in modules.items():
        module.weight.mul_(target_rms / max(rms[name], 1e-12))


def teacher_forced_logits(
    model,
    kv_cache_dtype: str,
    prompts,
    decode_len: int,
    block_size: int = 16,
    attention_backend: str = "auto",
    decoder: str = "auto",
):
    """The logits [len(prompt), vocab] of each prompt through a ModelRunner of `model` (owned decoder where the
    engine would use it): a prefill of all but the last `decode_len` tokens, then one decode step per token.
    `attention_backend`, `decoder`: EngineConfig's (auto: the Triton kernels on CUDA; a latent attention model's
    latent cache, "hf" its expanded per-head K/V)."""
    import torch

    from worker.engine.attention_backend import AttentionMetadata
    from worker.engine.config import EngineConfig
    from worker.engine.model_runner import ModelRunner

    device = next(model.parameters()).device
    max_len = max(len(p) for p in prompts)
    num_blocks = -(-max_len // block_size) + 1  # block 0 is the scratch block padding rows write
    config = EngineConfig(
        device=str(device), mode="sync", use_cuda_graphs=False, kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=max(max_len, 256),
        attention_backend=attention_backend, decoder=decoder,
    )  # fmt: skip
    runner = ModelRunner(model, config, device, num_blocks, max_len)
    table = torch.arange(1, num_blocks, dtype=torch.int32, device=device)[None]

    def step(token_ids, start: int, is_decode: bool) -> torch.Tensor:
        positions = torch.arange(start, start + len(token_ids), device=device)
        slots = (table[0].long()[positions // block_size] * block_size + positions % block_size).int()
        attn = AttentionMetadata(
            kv_caches=runner.kv_caches,
            slot_mapping=slots,
            block_tables=table,
            cu_seqlens_q=torch.tensor([0, len(token_ids)], dtype=torch.int32, device=device),
            context_lens=torch.tensor([start + len(token_ids)], dtype=torch.int32, device=device),
            max_query_len=len(token_ids),
            max_context_len=start + len(token_ids),
            is_decode_only=is_decode,
            backend=runner.attn_backend,
            num_decode_seqs=1 if is_decode else 0,
            sliding_windows=runner.sliding_windows,
            kv_scales=runner.kv_scales,
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        return runner._forward(ids, positions, attn, 0).float()  # NOTE: the runner's own forward, every row

    out = []
    with torch.inference_mode():
        for prompt in prompts:
            split = len(prompt) - decode_len
            rows = [step(prompt[:split], 0, False)]
            rows += [step(prompt[t : t + 1], t, True) for t in range(split, len(prompt))]
            out.append(torch.cat(rows))
    return out


def compare(reference, other) -> SetupQuality:
    import torch

    kls, agree = [], 0
    for ref, got in zip(reference, other, strict=True):
        ref_logp, got_logp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
        kls.append((ref_logp.exp() * (ref_logp - got_logp)).sum(-1).clamp_min(0))
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
    kl = torch.cat(kls)
    return SetupQuality(float(kl.mean()), float(kl.max()), agree / kl.numel(), kl.numel())


def peakedness(reference) -> dict:
    import torch

    logp = torch.log_softmax(torch.cat(reference), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return {
        "mean_entropy": float(entropy.mean()),
        "max_entropy": math.log(logp.shape[-1]),
        "mean_top1_prob": float(logp.max(-1).values.exp().mean()),
    }


@click.command("quality")
@click.option("--model", default="llama3-8b", show_default=True, help="A preset (random weights) whose shape to use.")
@click.option("--num-layers", type=click.IntRange(min=1), default=None, help="Keep the first N layers (quicker).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=2), default=512, show_default=True)
@click.option(
    "--decode-len", type=click.IntRange(min=0), default=32, show_default=True,
    help="The last N tokens of each prompt run as decode steps (the rest as one prefill).",
)  # fmt: skip
@click.option(
    "--logit-std", type=float, default=4.0, show_default=True,
    help="Scale the output head to this logit std on the reference (0: the init as is).",
)  # fmt: skip
@click.option(
    "--init", type=click.Choice(["scaled", "plain"]), default="scaled", show_default=True,
    help="scaled: unit embeddings and residual projections / sqrt(2 x layers) (a stable random model); "
    "plain: the preset's init.",
)  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def quality_bench(
    model, num_layers, num_prompts, prompt_len, decode_len, logit_std, init, seed, device, dtype, json_out
):
    """Teacher-forced logits of FP8 weights, FP8 KV and both vs the model dtype: mean KL and top-1 agreement."""
    import torch

    from worker.engine.models import resolve_device, resolve_dtype

    if decode_len >= prompt_len:
        raise click.BadParameter("must be below --prompt-len", param_hint="--decode-len")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    vocab = min(_vocab_size(model), 32000)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num_prompts)]
    probe = torch.tensor(prompts[0])
    reference_model, fp8_model = build_models(model, num_layers, dt, dev, seed, logit_std, probe, init)
    logits = {}
    for name, (fp8_weights, fp8_kv) in SETUPS.items():
        logits[name] = teacher_forced_logits(
            fp8_model if fp8_weights else reference_model, "fp8" if fp8_kv else "auto", prompts, decode_len
        )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    results = {name: compare(logits["reference"], logits[name]) for name in SETUPS if name != "reference"}
    peaked = peakedness(logits["reference"])
    reference_name = str(dt).removeprefix("torch.")
    click.echo(
        f"{model} ({reference_model.config.num_hidden_layers} layers), {num_prompts} prompts x {prompt_len} tokens "
        f"({decode_len} decoded), reference {reference_name}: entropy {peaked['mean_entropy']:.2f} of "
        f"{peaked['max_entropy']:.2f} nats, top-1 prob {peaked['mean_top1_prob']:.3f}"
    )
    click.echo(f"{'setup':<16} {'mean KL':>10} {'max KL':>10} {'top-1 agree':>12}")
    for name, q in results.items():
        click.echo(f"{name:<16} {q.mean_kl:>10.5f} {q.max_kl:>10.4f} {q.top1_agreement:>12.4f}")
    report = {
        "model": model,
        "num_layers": reference_model.config.num_hidden_layers,
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        "decode_len": decode_len,
        "logit_std": logit_std,
        "init": init,
        "reference_dtype": reference_name,
        "reference": peaked,
        "setups": {name: asdict(q) for name, q in results.items()},
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "seconds": time.perf_counter() - t0,
        "date": time.strftime("%Y-%m-%d"),
    }
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        click.echo(f"wrote {json_out}")


def _vocab_size(preset: str) -> int:
    from worker.engine.models.loader import preset_config

    return preset_config(preset).vocab_size
