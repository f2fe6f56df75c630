"""FP8 as a property of each linear in the owned decoder (issue 26).

CPU: `--quantization fp8` runs with its weights rounded to FP8 and dequantized, within FP8's tolerance of the
unquantized logits; with `keep_fp8` (what sm89+ CUDA does by default) the loader keeps each quantized linear as
an `Fp8LinearModule` and the owned decoder multiplies its fused q/k/v and gate/up FP8 weights, scales fused
with them, through the FP8 GEMM's emulation: greedy output equals `generate` on the same model (whose
linears run the same emulation one by one), for `--quantization fp8` and every checkpoint format.

GPU (`gpu`, run on the H200): the FP8 kernels (kept FP8 weights, cuBLASLt / Triton GEMMs) against their
emulation on the same model, and the owned decoder's greedy output against `generate`.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.fixtures.checkpoints import corpus
from tests.fixtures.fp8_checkpoints import FORMATS, build_fp8_checkpoint
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.kv_cache import check_kv_cache_dtype
from worker.engine.models import load_model
from worker.engine.quant import kernels
from worker.engine.quant.linear import Fp8LinearModule, Fp8Weight

CPU = torch.device("cpu")
FAMILY = {"fp8-block": "qwen3", "ct-channel-dynamic": "llama3", "ct-tensor-static": "llama3", "ct-block": "qwen3",
          "fbgemm": "llama3"}  # as test_quant_checkpoints.py


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0].float()


def _compare(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error of the logits, top-1 agreement over positions)."""
    rel = float((logits - reference).norm() / reference.norm())
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    return rel, top1


def test_quantization_fp8_on_the_cpu_is_within_fp8_tolerance_of_the_dense_model():
    """Each linear's output is within e4m3's rounding (2^-4) of the dense one. End to end the random-weight
    model amplifies it (tiny-llama's large init scale: about 19% of the logits' norm after two layers, where
    one linear errs by 3%), so the logits are only checked to stay close and mostly agree on the top token."""
    dense, _ = load_model("tiny-llama", CPU, torch.float32)
    quantized, _ = load_model("tiny-llama", CPU, torch.float32, quantization="fp8")
    assert not any(isinstance(m, Fp8LinearModule) for m in quantized.modules()), "the CPU runs dequantized weights"
    for name, linear in dense.named_modules():
        if not isinstance(linear, torch.nn.Linear):
            continue
        inputs = torch.randn(32, linear.in_features, generator=torch.Generator().manual_seed(2))
        want, got = linear(inputs), quantized.get_submodule(name)(inputs)
        rel = float((got - want).norm() / want.norm())
        assert (rel == 0) if name == "lm_head" else (0 < rel < 2.0**-4), (name, rel)
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(0))
    rel, top1 = _compare(_logits(quantized, ids), _logits(dense, ids))
    assert 0 < rel < 0.3 and top1 >= 0.6, (rel, top1)


def _requests(tokenizer, num: int, max_new_tokens: int = 16) -> list[EngineRequest]:
    texts = corpus(num, seed=3)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    return [EngineRequest(f"r{i}", tokenizer.encode(text)[:60], sampling) for i, text in enumerate(texts)]


def _greedy(model, tokenizer, req: EngineRequest) -> list[int]:
    """`generate` on the model, stopping on every eos id the engine stops on."""
    ids = torch.tensor([req.prompt_ids], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=req.sampling.max_new_tokens,
        eos_token_id=sorted(tokenizer.eos_token_ids), pad_token_id=sorted(tokenizer.eos_token_ids)[0],
    )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def _check_fp8_decoder(model, tokenizer, num_requests: int = 6) -> None:
    """The owned decoder holds FP8 GEMM weights, views the modules' bytes, and decodes as `generate` does."""
    engine = Engine(model, tokenizer, EngineConfig(decoder="owned", max_num_batched_tokens=64))
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.is_quantized and decoder.small_step_ops is None
    attn = model.model.layers[-1].self_attn
    qkv_modules = [attn.q_proj, attn.k_proj, attn.v_proj]
    if all(isinstance(m, Fp8LinearModule) for m in qkv_modules):  # fbgemm's release leaves attention in bf16
        fused = decoder.layers[-1].qkv_weight
        assert isinstance(fused, Fp8Weight)
        assert fused.layer.out_features == sum(m.out_features for m in qkv_modules)
        assert attn.q_proj.weight.data_ptr() == fused.layer.weight.data_ptr(), "q_proj views the fused rows"
    assert isinstance(decoder.layers[-1].down_weight, Fp8Weight)
    reqs = _requests(tokenizer, num_requests)
    reference = {r.request_id: _greedy(model, tokenizer, r) for r in reqs}
    results = engine.generate(reqs)
    assert {r.request_id: r.token_ids for r in results} == reference
    assert len({t for ids in reference.values() for t in ids}) > 10, "diverse greedy text"


def test_owned_decoder_multiplies_fp8_linears_quantized_at_load():
    model, tokenizer = load_model("tiny-llama", CPU, torch.float32, quantization="fp8", keep_fp8=True)
    modules = [m for m in model.modules() if isinstance(m, Fp8LinearModule)]
    assert len(modules) == 7 * model.config.num_hidden_layers, "every decoder linear, not the output head"
    assert not isinstance(model.lm_head, Fp8LinearModule)
    _check_fp8_decoder(model, tokenizer)
    first, second = (Engine(model, tokenizer, EngineConfig(decoder="owned", num_kv_blocks=8)) for _ in range(2))
    fused = [e.runner.decoder.layers[0].gate_up_weight for e in (first, second)]
    assert all(isinstance(w, Fp8Weight) for w in fused)
    assert fused[0].layer.weight.data_ptr() == fused[1].layer.weight.data_ptr(), "a second engine reuses the rows"
    torch.testing.assert_close(fused[0].layer.weight_scale, fused[1].layer.weight_scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_owned_decoder_multiplies_each_checkpoint_format_in_fp8(tmp_path, fmt):
    fp8 = build_fp8_checkpoint(tmp_path, fmt, FAMILY[fmt])
    model, tokenizer = load_model(str(fp8.path), CPU, torch.float32, keep_fp8=True)
    assert any(isinstance(m, Fp8LinearModule) for m in model.modules())
    _check_fp8_decoder(model, tokenizer, num_requests=4)


def test_engine_config_takes_quantization_and_an_fp8_kv_cache_only_where_it_runs(monkeypatch):
    engine = Engine.from_model("tiny-llama", device="cpu", quantization="fp8", num_kv_blocks=64)
    assert engine.config.quantization == "fp8"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"  # the torch attention reads it (CPU)
    check_kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8"), torch.device("cpu"))
    # CUDA: the Triton kernels convert e4m3 on sm89+ only (an A100 is refused in one line, an H100 runs it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs an sm89\\+ GPU"):
        check_kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8"), torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8"), torch.device("cuda"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="awq")


# -- GPU (H200) ------------------------------------------------------------------------------------------

needs_fp8_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)), reason="needs an sm89+ GPU"
)


def _emulated_logits(monkeypatch, model, ids: torch.Tensor) -> torch.Tensor:
    """The same model's logits with every FP8 GEMM run as its emulation (fp8.py: the same quantized activations,
    dequantized weights, an fp32 GEMM), the reference issue 26 names for the GPU path."""
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "has_fp8_tensor_cores", lambda device: False)
        return _logits(model, ids)


# The FP8 kernels against their emulation. Per linear, on the same input, both accumulate in fp32 and round the
# output to bf16: they differ by the last bits (GPU_LINEAR_REL). End to end the difference cannot stay that small:
# each linear re-quantizes its input to e4m3 (3 mantissa bits), so a last-bit difference upstream flips some
# roundings by 1/16 downstream, and the random-weight layers carry that on (measured on the H200, 2026-12-01:
# logits rel 0.07 to 0.15, top-1 0.75 to 0.88 vs the emulation; the same order as FP8 itself vs bf16 on the CPU,
# test_quantization_fp8_on_the_cpu_is_within_fp8_tolerance_of_the_dense_model). So the model-level bounds are
# FP8's own tolerance, and exactness is asked of each GEMM.
GPU_LINEAR_REL = 0.01
GPU_LOGITS_REL = 0.3
GPU_TOP1 = 0.6


def _check_each_linear_matches_its_emulation(model, ids: torch.Tensor) -> int:
    """Runs the model once, capturing every FP8 linear's input, then compares the kernels with the emulation on
    exactly that input. Returns how many linears were checked."""
    captured: list[tuple[str, Fp8LinearModule, torch.Tensor]] = []
    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: captured.append((name, m, args[0].detach())))
        for name, module in model.named_modules()
        if isinstance(module, Fp8LinearModule)
    ]
    try:
        _logits(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    for name, module, x in captured:
        got = kernels.fp8_linear(x, module.layer, module.bias, backend="kernels").float()
        want = kernels.fp8_linear(x, module.layer, module.bias, backend="emulated").float()
        rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
        assert rel < GPU_LINEAR_REL, (name, module.scheme, rel)
    return len(captured)


def test_quantization_fp8_keeps_each_linear_on_the_device_of_its_weight():
    """`--quantization fp8` quantizes a model where it lies (a preset built on the GPU): each FP8 linear's weight
    and scales stay on its weight's device (the "meta" device here stands for CUDA; the CPU cannot tell)."""
    from worker.engine.quant.config import OnlineFp8Config
    from worker.engine.quant.linear import quantize_linears

    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).to("meta")
    quantize_linears(model, OnlineFp8Config(), keep_fp8=True)
    assert isinstance(model[0], Fp8LinearModule)
    assert {t.device.type for t in model[0].state_dict().values()} == {"meta"}


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_quantization_fp8_runs_fp8_gemms_that_match_their_emulation(monkeypatch):
    cuda = torch.device("cuda")
    model, tokenizer = load_model("small-llama", cuda, torch.bfloat16, quantization="fp8")
    assert any(isinstance(m, Fp8LinearModule) for m in model.modules()), "sm89+ keeps FP8 weights"
    ids = torch.randint(0, 256, (1, 256), device=cuda, generator=torch.Generator(cuda).manual_seed(0))
    assert _check_each_linear_matches_its_emulation(model, ids) == 7 * model.config.num_hidden_layers
    rel, top1 = _compare(_logits(model, ids), _emulated_logits(monkeypatch, model, ids))
    print(f"small-llama --quantization fp8: logits rel {rel:.4f}, top-1 agreement {top1:.3f} vs the emulation")
    assert rel < GPU_LOGITS_REL and top1 >= GPU_TOP1, (rel, top1)
    engine = Engine(model, tokenizer, EngineConfig(decoder="owned", max_num_batched_tokens=512))
    assert engine.runner.decoder is not None and engine.runner.decoder.is_quantized
    # The first token is one more top-1 of the same FP8 math run two ways (the engine's fused GEMMs and attention
    # vs transformers' forward): GPU_TOP1's bound, not more. 64 prompts, not 16: at the H200's top-1 of about
    # 0.75 (2026-12-01: 11 of 16, then 9 of 16 against a bound of 10), 16 draws fall under 0.6 one run in twelve.
    num = 64
    reqs = _requests(tokenizer, num, max_new_tokens=8)
    results = engine.generate(reqs)
    firsts = [
        r.token_ids[:1] == _greedy(model, tokenizer, dataclasses.replace(q, sampling=dataclasses.replace(q.sampling, max_new_tokens=1)))
        for q, r in zip(reqs, results, strict=True)
    ]
    print(f"small-llama --quantization fp8: first tokens agree with generate() on {sum(firsts)} of {num}")
    assert sum(firsts) >= math.ceil(GPU_TOP1 * num), f"first tokens agree with generate() on {sum(firsts)} of {num}"


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_checkpoint_formats_run_fp8_gemms_in_the_owned_decoder(tmp_path, monkeypatch, fmt):
    fp8 = build_fp8_checkpoint(tmp_path, fmt, FAMILY[fmt])
    cuda = torch.device("cuda")
    model, tokenizer = load_model(str(fp8.path), cuda, torch.bfloat16)
    assert any(isinstance(m, Fp8LinearModule) for m in model.modules()), "sm89+ keeps FP8 weights"
    ids = torch.randint(0, 256, (1, 128), device=cuda, generator=torch.Generator(cuda).manual_seed(0))
    assert _check_each_linear_matches_its_emulation(model, ids) > 0
    rel, top1 = _compare(_logits(model, ids), _emulated_logits(monkeypatch, model, ids))
    print(f"{fmt}: logits rel {rel:.4f}, top-1 agreement {top1:.3f} vs the emulation")
    assert rel < GPU_LOGITS_REL and top1 >= GPU_TOP1, (fmt, rel, top1)
    engine = Engine(model, tokenizer, EngineConfig(decoder="owned", max_num_batched_tokens=256))
    assert engine.runner.decoder is not None and engine.runner.decoder.is_quantized
    reqs = _requests(tokenizer, 8)
    results = engine.generate(reqs)
    firsts = [r.token_ids[:1] == _greedy(model, tokenizer, q)[:1] for q, r in zip(reqs, results, strict=True)]
    print(f"{fmt}: first tokens agree with generate() on {sum(firsts)} of 8")
    # The owned decoder's fused q/k/v and gate/up GEMMs round differently from transformers' separate ones, and
    # the FP8 re-quantization downstream amplifies that (GPU_LOGITS_REL): most, not all, first tokens agree.
    assert sum(firsts) >= math.ceil(GPU_TOP1 * 8), f"{fmt}: first tokens agree with generate() on {sum(firsts)} of 8"
