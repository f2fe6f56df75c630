"""Deterministic mode's kernels give a row the same bits whatever step it is computed in (deterministic.py).

The checks take a device: on CUDA (`gpu`) they test the hardware's arithmetic; on CPU through Triton's interpreter
(a subprocess with TRITON_INTERPRET=1, as test_attention_triton.py does) they test what the kernels decide: tile
shapes, KV tile alignment, reduction order, masking. The torch path (CPU deterministic mode) runs in-process.

  attention: a sequence's rows computed whole, in chunks, as decode rows, alone or among 1-40 sequences of other
             traffic, with padding rows and larger max_query_len hints: the same bits
  GEMMs:     a row of x alone or among 3, 17, 40 or 100 rows (past one 64-row tile): the same bits, for the plain,
             gated (SiLU·mul) and QKV-with-rotary-and-KV-write products
  decoder:   the logits of a prompt computed whole vs chunked among other prompts, of a decode alone vs in a
             padded batch of decodes, and of that decode vs its token recomputed inside the prompt: the same bits
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.engine.kernels import attention as at

REPO_ROOT = Path(__file__).resolve().parents[3]
H, KVH, D, BS = 4, 2, 16, 16  # attention shapes: a group of 2 query heads per KV head


def _pick(
    c: dict, q_rows: list[torch.Tensor], step, pad_seqs: int = 0, pad_rows: int = 0, max_q: int | None = None,
    tiles_by_step: bool = False,
):  # fmt: skip
    """Run the batch-invariant prefill kernel on `step` [(sequence, context now, query rows)], plus `pad_seqs`
    padding sequences (context 0, one row) and `pad_rows` rows past the last sequence. Returns each step entry's
    output rows."""
    dev = c["q"].device
    q = [q_rows[s][ctx - n : ctx] for s, ctx, n in step]
    q += [torch.randn(pad_seqs + pad_rows, H, D).to(c["q"])]
    tables = c["block_tables"][[s for s, _, _ in step]]
    tables = torch.cat([tables, torch.zeros(pad_seqs, tables.shape[1], dtype=tables.dtype, device=dev)])
    q_lens = [n for _, _, n in step] + [1] * pad_seqs
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    ctx = torch.tensor([c for _, c, _ in step] + [0] * pad_seqs, dtype=torch.int32, device=dev)
    out = at.paged_prefill_attention(
        torch.cat(q), c["k_cache"], c["v_cache"], tables, cu, ctx, c["scale"],
        max_query_len=max_q or max(q_lens), batch_invariant=True, tiles_by_step=tiles_by_step,
    )  # fmt: skip
    assert (out[cu[-1] :] == 0).all() if pad_rows else True, "rows past the last sequence must be zeros"
    return [out[cu[i] : cu[i + 1]] for i in range(len(step))]


def check_attention_rows(device: str, dtype: torch.dtype, seed: int = 0, tiles_by_step: bool = False) -> None:
    """`tiles_by_step`: the query tile shrinks with the step's longest query (deterministic mode where
    query_tiles_agree holds); the reference rows are computed with the full tile either way."""
    from functools import partial

    from tests.worker.engine.test_attention_triton import make_case

    rng = random.Random(seed)
    target_len = 45
    ctx_lens = [target_len] + [rng.randint(1, 70) for _ in range(39)]
    c = make_case(ctx_lens, ctx_lens, H, KVH, D, BS, dtype, device, seed)
    q_rows = list(c["q"].split(ctx_lens))
    whole = _pick(c, q_rows, [(0, target_len, target_len)])[0]
    assert not torch.isnan(whole).any()
    _pick_step = partial(_pick, tiles_by_step=tiles_by_step)

    def traffic(k: int):
        """k steps entries of other sequences: prompt chunks and decodes at random contexts."""
        entries = []
        for s in rng.sample(range(1, len(ctx_lens)), k):
            ctx = rng.randint(1, ctx_lens[s])
            entries.append((s, ctx, rng.choice([1, 1, rng.randint(1, ctx)])))
        return entries

    # Chunked: every partition's rows equal the whole prompt's, alone and among other traffic.
    for cuts in ([1, 17, 40], [13, 32, 44]):
        bounds = [0, *cuts, target_len]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            others = traffic(rng.choice([0, 2, 16]))
            at_index = rng.randint(0, len(others))
            step = others[:at_index] + [(0, hi, hi - lo)] + others[at_index:]
            got = _pick_step(c, q_rows, step, pad_rows=rng.choice([0, 3]))[at_index]
            assert torch.equal(got, whole[lo:hi]), (dtype, cuts, lo, hi, tiles_by_step)
    # Decode rows (one query row at its position) in batches of 1, 3, 17 and 40, padded or not, any max_q hint.
    for pos, sizes in ((0, (3, 40)), (16, (1, 17)), (44, (1, 3, 17, 40))):
        for size in sizes:
            others = traffic(size - 1)
            at_index = rng.randint(0, len(others))
            step = others[:at_index] + [(0, pos + 1, 1)] + others[at_index:]
            pad_seqs, max_q = rng.choice([(0, None), (5, None), (2, 64)])
            got = _pick_step(c, q_rows, step, pad_seqs=pad_seqs, max_q=max_q)[at_index]
            assert torch.equal(got, whole[pos : pos + 1]), (dtype, pos, size, pad_seqs, max_q, tiles_by_step)


def check_gemm_rows(device: str, dtype: torch.dtype, seed: int = 0) -> None:
    """Every row's bits are the same at any M and offset, under the plan the build-time check picks (small tiles of
    16-64 rows by M below `large_m` rows, large ones above, for the shapes where all give the same bits; here
    large_m is 24 so that steps of 1-100 rows cross it)."""
    import dataclasses

    from worker.engine.kernels import invariant_gemm as ig

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    k = 128
    x_all = randn(100, k)
    heads, kv_heads, head_dim, block = 2, 1, 64, 16  # QKV: 2 query heads and 1 KV head of 64
    weights = {
        "linear": randn(128, k, scale=k**-0.5),
        "gate_up_silu": randn(256, k, scale=k**-0.5),  # intermediate 128
        "qkv": randn((heads + 2 * kv_heads) * head_dim, k, scale=k**-0.5),
        "vocab shard": randn(160, k, scale=k**-0.5),  # a TP rank's lm_head: not a multiple of 64 rows
    }
    gemms = dataclasses.replace(ig.InvariantGemms.for_weights(weights, {"gate_up_silu"}), large_m=24)
    cases = {
        "linear": (gemms.linear, weights["linear"], randn(128)),
        "gate_up_silu": (gemms.gate_up_silu, weights["gate_up_silu"], None),
        "vocab shard": (gemms.linear, weights["vocab shard"], None),
    }
    for name, (fn, w, b) in cases.items():
        full = fn(x_all, w, b)
        for m in (1, 3, 17, 40, 100):
            for start in {0, 7, 100 - m}:
                got = fn(x_all[start : start + m], w, b)
                assert torch.equal(got, full[start : start + m]), (dtype, name, m, start, gemms.large_m)
    # QKV with rotary and the KV write in the epilogue (the small plan) or after the GEMM (the large one).
    w = weights["qkv"]
    angles = torch.arange(128.0)[:, None] * torch.logspace(0, -3, head_dim // 2)[None, :]
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype).to(device)
    positions = torch.randint(0, 128, (100,), generator=gen).to(device)
    slots = (torch.randperm(100, generator=gen) + block).to(device)  # block 0 is scratch

    def qkv(rows: slice):
        caches = [torch.zeros(8, block, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
        q = gemms.qkv_rope_write(
            x_all[rows], w, None, positions[rows], cos, sin, heads, kv_heads, *caches, slots[rows]
        )
        flat = [cache.view(-1, kv_heads, head_dim)[slots[rows]] for cache in caches]
        return q, *flat

    full = qkv(slice(0, 100))
    for m in (1, 3, 17, 40, 60):
        got = qkv(slice(5, 5 + m))
        for part, g, f in zip(("q", "k", "v"), got, full, strict=True):
            assert torch.equal(g, f[5 : 5 + m]), (dtype, "qkv_rope_write", part, m)


def tiny_model(device: str, dtype: torch.dtype = torch.bfloat16, family: str = "llama"):
    """A Llama or Qwen3 (q/k norms: rotary outside the GEMM) whose shapes tile for the invariant GEMMs (head_dim
    64: Llama's QKV GEMM runs its rotary epilogue)."""
    import transformers

    torch.manual_seed(3)
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in names[family])
    config = config_cls(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, initializer_range=0.25,
    )  # fmt: skip
    return model_cls(config).to(device=device, dtype=dtype).eval()


class _Steps:
    """Steps of a deterministic owned decoder over its own paged cache: sequence s owns blocks 1 + 4s .. 4 + 4s."""

    def __init__(self, model, device: str, use_triton: bool):
        from worker.engine import deterministic
        from worker.engine.attention_backend import AttentionBackend, TritonAttentionBackend
        from worker.engine.decoder import OwnedDecoder
        from worker.engine.kv_cache import allocate_kv_cache

        self.device = torch.device(device)
        self.decoder = OwnedDecoder(model, 64, use_triton=use_triton, deterministic=True)
        assert self.decoder.use_triton == use_triton
        default = TritonAttentionBackend() if use_triton else AttentionBackend()
        self.caches = allocate_kv_cache(model.config, 1 + 4 * 8, 16, model.dtype, self.device)
        self.backend = deterministic.attention_backend(
            default, self.caches[0][0], model.config.num_attention_heads, model.dtype
        )
        if use_triton and device == "cpu":  # the interpreter leaves bits to the K order: decode steps shrink the
            # tile (on a GPU that is the hardware's answer: test_gpu_llama_attention_tiles_by_step asks it)
            assert self.backend.tiles_by_step, "query_tiles_agree found a query tile that changes a row's bits"

    def run(self, chunks, tokens: dict[int, list[int]], pad_seqs: int = 0) -> list[torch.Tensor]:
        """chunks [(sequence, start, num_tokens)]; returns each chunk's last-row logits."""
        from worker.engine.attention_backend import AttentionMetadata

        ids, positions, slots, cu, ctx = [], [], [], [0], []
        for s, start, n in chunks:
            ids += tokens[s][start : start + n]
            positions += list(range(start, start + n))
            slots += [(1 + 4 * s + p // 16) * 16 + p % 16 for p in range(start, start + n)]
            cu.append(cu[-1] + n)
            ctx.append(start + n)
        for _ in range(pad_seqs):  # a graph bucket's padding: context 0, the scratch block
            ids, positions, slots, cu, ctx = (
                ids + [0],
                positions + [0],
                slots + [0],
                cu + [cu[-1] + 1],
                ctx + [0],
            )
        tables = [[1 + 4 * s + i for i in range(4)] for s, _, _ in chunks] + [[0] * 4] * pad_seqs
        i32 = dict(dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            kv_caches=self.caches,
            slot_mapping=torch.tensor(slots, **i32),
            block_tables=torch.tensor(tables, **i32),
            cu_seqlens_q=torch.tensor(cu, **i32),
            context_lens=torch.tensor(ctx, **i32),
            max_query_len=max(n for _, _, n in chunks),
            max_context_len=max(ctx),
            is_decode_only=all(n == 1 for _, _, n in chunks),
            num_decode_seqs=next((i for i, (_, _, n) in enumerate(chunks) if n != 1), len(chunks)) + (
                pad_seqs if all(n == 1 for _, _, n in chunks) else 0
            ),
            backend=self.backend,
        )
        rows = torch.tensor(cu[1 : len(chunks) + 1], device=self.device) - 1
        with torch.inference_mode():
            logits = self.decoder(torch.tensor(ids, **i32), torch.tensor(positions, **i32), meta, rows)
        return list(logits)


def check_decoder_rows(
    device: str, use_triton: bool, dtype: torch.dtype = torch.bfloat16, seed: int = 0, family: str = "llama"
) -> None:
    """A prompt's logits whole and alone vs chunked among other prompts; a decode alone vs in a padded batch."""
    rng = random.Random(seed)
    model = tiny_model(device, dtype, family)
    tokens = {s: [rng.randrange(320) for _ in range(60)] for s in range(8)}  # sequence 0 is the target
    alone = _Steps(model, device, use_triton)
    want_prompt = alone.run([(0, 0, 20)], tokens)[0]
    want_decode = alone.run([(0, 20, 1)], tokens)[0]

    busy = _Steps(model, device, use_triton)
    busy.run([(3, 0, 9), (0, 0, 13), (5, 0, 30)], tokens)
    got_prompt = busy.run([(1, 0, 40), (0, 13, 7), (2, 0, 1)], tokens)[1]
    assert torch.equal(got_prompt, want_prompt), "a prompt chunked among other prompts"
    decodes = [(3, 9, 1), (1, 40, 1), (0, 20, 1), (5, 30, 1), (2, 1, 1)]
    got_decode = busy.run(decodes, tokens, pad_seqs=3)[2]
    assert torch.equal(got_decode, want_decode), "a decode in a padded batch of decodes"
    # A decode leading a mixed step (the attention backend's decode rows then take their own query tiles)
    mixed = _Steps(model, device, use_triton)
    mixed.run([(0, 0, 20)], tokens)
    assert torch.equal(mixed.run([(0, 20, 1), (4, 0, 33), (6, 0, 2)], tokens)[0], want_decode), "a decode in a mixed step"
    # The decoded token recomputed inside a longer prompt (a preemption's recompute, a prompt that continues
    # an earlier output and so hits its cached blocks): the same bits as computed as a decode.
    recompute = _Steps(model, device, use_triton)
    assert torch.equal(recompute.run([(0, 0, 21)], tokens)[0], want_decode), "a decode recomputed with its prompt"


@pytest.fixture(autouse=True)
def one_thread():
    """Row-at-a-time ops are tiny: on a loaded machine torch's thread pool made each cost ~15 ms, not ~50 us."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_path_rows_are_batch_invariant(dtype):
    """CPU deterministic mode (row_linear, RowAttentionBackend), in this process."""
    check_decoder_rows("cpu", use_triton=False, dtype=dtype)


def test_the_check_catches_the_default_torch_path(monkeypatch):
    """The same check on the default CPU ops (one GEMM per step, attention per sequence): in fp32 torch's CPU
    GEMMs round a row differently at different M, so it must fail (bf16 happened to agree on this machine)."""
    from worker.engine.attention_backend import AttentionBackend
    from worker.engine.layer_ops import layer_ops

    init = _Steps.__init__

    def default_init(self, model, device, use_triton):
        init(self, model, device, use_triton)
        self.decoder.ops, self.backend = layer_ops(False, False), AttentionBackend()

    monkeypatch.setattr(_Steps, "__init__", default_init)
    try:
        check_decoder_rows("cpu", use_triton=False, dtype=torch.float32)
    except AssertionError:
        return
    pytest.skip("this machine's CPU GEMMs happen to be row-invariant: nothing to catch")


INTERPRETER_CHECKS = r"""
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from tests.worker.engine.test_fused_kernels import order_independent_interpreter_dots
from tests.worker.engine import test_deterministic_kernels as t
import torch

# The host's sgemm may round a row by where it sits in the tile (AMD EPYC, numpy 2.4): dots sum in float64. Patched
# first, so that _patch_triton_interpreter's bf16 widening runs before it and bf16 tiles take it too.
order_independent_interpreter_dots()
_patch_triton_interpreter()
t.check_attention_rows("cpu", torch.bfloat16)
t.check_attention_rows("cpu", torch.bfloat16, tiles_by_step=True)
for dtype in (torch.float32, torch.bfloat16):
    t.check_gemm_rows("cpu", dtype)
for family in ("llama", "qwen3"):
    t.check_decoder_rows("cpu", use_triton=True, family=family)
print("deterministic kernels are row-invariant")
"""


@pytest.mark.skipif(not at.HAVE_TRITON, reason="triton is not installed")
def test_kernels_are_row_invariant_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")  # tiny ops: threads only cost
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECKS],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "row-invariant" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and at.HAVE_TRITON), reason="needs CUDA and triton")
def test_gpu_kernels_are_row_invariant():
    from worker.engine import deterministic

    for dtype in (torch.bfloat16, torch.float32):
        check_attention_rows("cuda", dtype)
        # the shrinking query tile where the engine would take it (the probe's verdict on these shapes)
        if deterministic.query_tiles_agree(torch.zeros(1, BS, KVH, D, device="cuda", dtype=dtype), H, dtype):
            check_attention_rows("cuda", dtype, tiles_by_step=True)
        check_gemm_rows("cuda", dtype)
    for family in ("llama", "qwen3"):
        check_decoder_rows("cuda", use_triton=True, family=family)


@pytest.mark.parametrize(
    "name, shape",
    [  # [N, K] of the weights of the models `bench engine` runs; the down projections are deeper than MAX_K
        ("llama3-8b qkv", (6144, 4096)), ("llama3-8b o", (4096, 4096)), ("llama3-8b gate_up", (28672, 4096)),
        ("llama3-8b down", (4096, 14336)), ("llama3-8b lm_head", (128256, 4096)),
        ("qwen2.5-7b down", (3584, 18944)),
        # a rank's vocabulary at --tensor-parallel-size 2: rows that are not a multiple of 64
        ("phi-3 lm_head / 2", (16032, 3072)), ("gemma-3 lm_head / 2", (131104, 3840)), ("small-llama / 2", (160, 512)),
    ],
)  # fmt: skip
def test_release_shaped_weights_tile_for_the_invariant_gemm(name, shape):
    from worker.engine.kernels import invariant_gemm

    weight = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    assert invariant_gemm.untiled({name: weight}) == [], f"deterministic mode would refuse {name} {shape}"


def test_the_build_time_check_keeps_one_plan_where_large_tiles_change_bits(monkeypatch):
    """InvariantGemms.for_weights tiles a weight by M only where every tile gives it the same bits: a large plan
    that rounds differently (here a product nudged by 1e-3 in its large tiles) leaves one plan for every M."""
    from worker.engine.kernels import decode_gemm as dg
    from worker.engine.kernels import invariant_gemm as ig

    def fake_linear(x, weight, bias=None, *, block_m=None, **_):  # torch's GEMM; the "large tiles" land off by 1e-3
        out = torch.nn.functional.linear(x, weight, bias)
        return out * (1 + 1e-3) if block_m == ig.LARGE_BLOCK_M else out

    monkeypatch.setattr(dg, "decode_linear", fake_linear)
    weights = {"o": torch.randn(128, 64), "lm_head": torch.randn(256, 64), "odd": torch.randn(96, 64)}
    weights["untiled"] = torch.randn(72, 64)  # no tile width divides 72 rows: refused, never probed
    gemms = ig.InvariantGemms.for_weights(weights, set())
    assert gemms.large_shapes == frozenset()
    assert gemms.small_by_m == {(128, 64, False), (256, 64, False), (96, 64, False)}  # 96 rows: 32-wide tiles
    monkeypatch.setattr(dg, "decode_linear", lambda x, w, b=None, **_: torch.nn.functional.linear(x, w, b))
    # 96 rows do not tile by 128: never large
    assert ig.InvariantGemms.for_weights(weights, set()).large_shapes == {(128, 64, False), (256, 64, False)}
    assert ig.untiled(weights) == ["untiled"]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and at.HAVE_TRITON), reason="needs CUDA and triton")
def test_gpu_llama_shapes_tile_by_m():
    """On the H200 the build-time check finds the same bits under both plans for every Llama-3-8B projection in
    bf16 (benchmarks/invariant_gemm_sweep.py measured it), so deterministic mode's large steps take the large tiles."""
    from worker.engine.kernels import invariant_gemm as ig

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}  # fmt: skip
    weights = {name: torch.randn(shape, device="cuda", dtype=torch.bfloat16) / shape[1] ** 0.5 for name, shape in shapes.items()}
    gemms = ig.InvariantGemms.for_weights(weights, {"gate_up"}, pdl=True)
    shapes = {(*w.shape, name == "gate_up") for name, w in weights.items()}
    assert gemms.large_shapes == shapes, "large tiles change bits here: large steps keep the decode tiles"
    assert gemms.small_by_m == shapes, "16- or 32-row programs change bits here: decode steps keep 64"


def test_the_attention_probe_refuses_a_tile_that_changes_bits(monkeypatch):
    """query_tiles_agree turns the decode-heavy shrink on only where it changes no bit: a kernel whose shrunk
    tiles round differently (here nudged by 1e-3) keeps one query tile for every step."""
    from worker.engine import deterministic
    from worker.engine.attention import paged_attention_ref

    def fake_prefill(q, k, v, tables, cu, ctx, scale, *, max_query_len=None, tiles_by_step=False, **_):
        out = paged_attention_ref(q, k, v, tables, cu, ctx, scale)
        return out * (1 + 1e-3) if tiles_by_step and max_query_len is not None and max_query_len <= 8 else out

    monkeypatch.setattr(at, "paged_prefill_attention", fake_prefill)
    k_cache = torch.zeros(4, BS, KVH, D)
    assert deterministic.query_tiles_agree(k_cache, H, torch.float32) is False
    monkeypatch.setattr(at, "paged_prefill_attention", lambda *a, tiles_by_step=False, **k: fake_prefill(*a, **k))
    assert deterministic.query_tiles_agree(k_cache, H, torch.float32) is True


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and at.HAVE_TRITON), reason="needs CUDA and triton")
def test_gpu_llama_attention_tiles_by_step():
    """For Llama-3-8B's attention (32 heads, 8 KV heads, head_dim 128, blocks of 16, bf16) the probe keeps the
    decode-heavy shrink: deterministic decode steps run 16-row query tiles, not 128 (W2's attention time)."""
    from worker.engine import deterministic

    k_cache = torch.zeros(8, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert deterministic.query_tiles_agree(k_cache, 32, torch.bfloat16), "a query tile changes a row's bits here"


def test_a_tile_the_gpu_cannot_launch_is_not_taken(monkeypatch):
    """A probe variant that Triton cannot launch (OutOfResources: shared memory) counts as a disagreement: the
    plan keeps the tiles that ran instead of failing the engine's start."""
    from worker.engine.kernels import decode_gemm as dg
    from worker.engine.kernels import invariant_gemm as ig
    from worker.engine.kernels.common import OutOfResources

    def linear(x, w, b=None, *, block_m=None, **_):
        if block_m == ig.LARGE_BLOCK_M:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return torch.nn.functional.linear(x, w, b)

    monkeypatch.setattr(dg, "decode_linear", linear)
    gemms = ig.InvariantGemms.for_weights({"o": torch.randn(128, 64)}, set())
    assert gemms.large_shapes == frozenset() and gemms.small_by_m == {(128, 64, False)}
