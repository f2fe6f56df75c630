"""Time the Triton paged-attention kernels on a CUDA GPU (H200 in mind), Llama-3-8B attention shape.

    python benchmarks/gpu_kernels.py            # default suite, < 60 s on an H200
    python benchmarks/gpu_kernels.py --sweep    # also sweep decode tile / stages / warps / splits

Decode reports GB/s over the K/V bytes each call must read (vs 4300 GB/s HBM); prefill reports causal
TFLOP/s next to torch's dense flash SDPA on the same tokens (same causal work, no paging). Times are medians
of triton.testing.do_bench (L2 flushed between calls); decode is also timed replayed from a CUDA graph.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine.attention import paged_attention_ref, write_kv_ref  # noqa: E402
from worker.engine.kernels import attention as at  # noqa: E402

HBM_GBPS = 4300.0
H, KVH, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B attention, engine default block size
DTYPE = torch.bfloat16


def make_paged(ctx_lens: list[int], q_lens: list[int], seed: int = 0) -> dict:
    """Random cache with shuffled blocks; context_lens include this step's tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-c // BLOCK) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32, device="cuda")
    start = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = perm[start : start + nb]
        start += nb
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return dict(
        q=torch.randn(cu[-1], H, D, device="cuda", dtype=DTYPE, generator=g),
        k_cache=torch.randn(num_blocks, BLOCK, KVH, D, device="cuda", dtype=DTYPE, generator=g),
        v_cache=torch.randn(num_blocks, BLOCK, KVH, D, device="cuda", dtype=DTYPE, generator=g),
        block_tables=tables,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device="cuda"),
        scale=D**-0.5,
        max_context_len=max(ctx_lens),
        max_query_len=max(q_lens),
    )


def bench(fn) -> float:
    """Median milliseconds."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def bench_graph(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decode_case(batch: int, ctx: int, graph: bool = True, **kw) -> None:
    c = make_paged([ctx] * batch, [1] * batch)
    out = torch.empty_like(c["q"])

    def run():
        at.paged_decode_attention(
            c["q"],
            c["k_cache"],
            c["v_cache"],
            c["block_tables"],
            c["context_lens"],
            c["scale"],
            out=out,
            max_context_len=c["max_context_len"],
            **kw,
        )

    run()
    kv_bytes = 2 * batch * ctx * KVH * D * c["k_cache"].element_size()
    splits = at.decode_num_splits(batch, KVH, D, DTYPE, ctx, device=out.device, **kw)
    ms = bench(run)
    line = (
        f"decode  B={batch:4d} ctx={ctx:5d} splits={splits:2d}  {ms * 1e3:8.1f} us  "
        f"{kv_bytes / ms / 1e6:7.0f} GB/s ({kv_bytes / ms / 1e6 / HBM_GBPS:5.1%} of {HBM_GBPS:.0f})  "
        f"ideal {kv_bytes / HBM_GBPS / 1e3:6.1f} us"
    )
    if graph:
        gms = bench_graph(run)
        line += f"  | graph {gms * 1e3:7.1f} us {kv_bytes / gms / 1e6:6.0f} GB/s"
    print(line, flush=True)


def prefill_runner(c: dict, out: torch.Tensor):
    """A no-argument closure launching the varlen prefill kernel on case `c` (for timing)."""

    def run():
        at.paged_prefill_attention(
            c["q"],
            c["k_cache"],
            c["v_cache"],
            c["block_tables"],
            c["cu_seqlens_q"],
            c["context_lens"],
            c["scale"],
            out=out,
            max_query_len=c["max_query_len"],
        )

    return run


def prefill_case(num_seqs: int, seq_len: int) -> None:
    c = make_paged([seq_len] * num_seqs, [seq_len] * num_seqs)
    out = torch.empty_like(c["q"])

    run = prefill_runner(c, out)

    run()
    # causal attention: QK^T and PV over the lower triangle (incl. diagonal)
    flops = 4.0 * num_seqs * H * D * (seq_len * (seq_len + 1) / 2)
    ms = bench(run)
    # dense flash attention on the same tokens: contiguous [B, H, S, D], K/V expanded to all heads
    qd = c["q"].view(num_seqs, seq_len, H, D).transpose(1, 2).contiguous()
    kd = torch.randn(num_seqs, H, seq_len, D, device="cuda", dtype=DTYPE)
    vd = torch.randn_like(kd)

    def run_dense():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

    try:
        run_dense()
        dms = bench(run_dense)
        dense = f"  | torch SDPA flash (dense) {dms * 1e3:7.1f} us {flops / dms / 1e9:6.1f} TFLOP/s"
    except Exception as e:  # no flash backend in this build
        dense = f"  | torch SDPA flash unavailable: {type(e).__name__}: {str(e)[:80]}"
    print(
        f"prefill {num_seqs} x {seq_len} tokens        {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s{dense}",
        flush=True,
    )


def mixed_case() -> None:
    """A chunked-prefill step: 2 chunks of 256 over 1K prefixes plus 64 decode rows in one launch."""
    ctx = [1280, 1280] + [700] * 64
    ql = [256, 256] + [1] * 64
    c = make_paged(ctx, ql)
    out = torch.empty_like(c["q"])

    run = prefill_runner(c, out)

    run()
    ms = bench(run)
    print(f"mixed   2x256 chunks + 64 decode rows   {ms * 1e3:8.1f} us", flush=True)


def write_kv_case(tokens: int) -> None:
    c = make_paged([tokens], [tokens])
    key = torch.randn(tokens, KVH, D, device="cuda", dtype=DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm(tokens, device="cuda").to(torch.int32)
    ms = bench(lambda: at.write_kv(key, value, c["k_cache"], c["v_cache"], slots))
    nbytes = 4 * key.numel() * key.element_size()  # read K,V + write K,V
    print(
        f"write_kv {tokens} tokens                {ms * 1e3:8.1f} us  {nbytes / ms / 1e6:7.0f} GB/s",
        flush=True,
    )


def reference_comparison() -> None:
    """Torch reference vs Triton at a small size (timing and error)."""
    batch, ctx = 8, 256
    c = make_paged([ctx] * batch, [1] * batch)
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"])
    ref = paged_attention_ref(*args, c["cu_seqlens_q"], c["context_lens"], c["scale"])
    out = at.paged_decode_attention(*args, c["context_lens"], c["scale"])
    ms_ref = bench(lambda: paged_attention_ref(*args, c["cu_seqlens_q"], c["context_lens"], c["scale"]))
    ms = bench(lambda: at.paged_decode_attention(*args, c["context_lens"], c["scale"]))
    print(
        f"decode  B={batch} ctx={ctx}: torch reference {ms_ref * 1e3:8.1f} us, triton {ms * 1e3:6.1f} us "
        f"({ms_ref / ms:5.0f}x), rel err {rel_err(out, ref):.2e}",
        flush=True,
    )
    pc = make_paged([300, 200, 64, 5], [300, 100, 1, 5])
    pargs = (
        pc["q"],
        pc["k_cache"],
        pc["v_cache"],
        pc["block_tables"],
        pc["cu_seqlens_q"],
        pc["context_lens"],
    )
    ref = paged_attention_ref(*pargs, pc["scale"])
    out = at.paged_prefill_attention(*pargs, pc["scale"], max_query_len=pc["max_query_len"])
    ms_ref = bench(lambda: paged_attention_ref(*pargs, pc["scale"]))
    ms = bench(lambda: at.paged_prefill_attention(*pargs, pc["scale"], max_query_len=pc["max_query_len"]))
    print(
        f"prefill mixed 406 rows: torch reference {ms_ref * 1e3:8.1f} us, triton {ms * 1e3:6.1f} us "
        f"({ms_ref / ms:5.0f}x), rel err {rel_err(out, ref):.2e}",
        flush=True,
    )
    key = torch.randn(64, KVH, D, device="cuda", dtype=DTYPE)
    slots = torch.randperm(pc["k_cache"].shape[0] * BLOCK, device="cuda")[:64].to(torch.int32)
    kc, vc = pc["k_cache"].clone(), pc["v_cache"].clone()
    write_kv_ref(key, key, kc, vc, slots)
    at.write_kv(key, key, pc["k_cache"], pc["v_cache"], slots)
    assert torch.equal(kc, pc["k_cache"]) and torch.equal(vc, pc["v_cache"]), "write_kv mismatch"


def sweep_decode() -> None:
    """Decode tile / pipeline / warp / split variants at W1's (B=32, ctx 768) and W2's (B=1000, ctx 600)
    decode shapes, timed from CUDA graphs as the engine runs them (patches the private config)."""
    orig = at._decode_config
    try:
        for batch, ctx in ((32, 768), (1000, 600)):
            for tile_n in (32, 64, 128):
                for stages in (2, 3, 4, 5):
                    for warps in (4, 8):
                        at._decode_config = lambda hd, dt, t=tile_n, s=stages, w=warps: (t, w, s)
                        print(f"  tile_n={tile_n} stages={stages} warps={warps}: ", end="")
                        try:
                            decode_case(batch, ctx, graph=True)
                        except Exception as e:  # out of shared memory etc.
                            print(f"failed: {type(e).__name__}: {str(e)[:100]}")
            at._decode_config = orig
            for max_splits in (1, 2, 4, 8, 16):
                print(f"  max_num_splits={max_splits}: ", end="")
                decode_case(batch, ctx, graph=True, max_num_splits=max_splits)
    finally:
        at._decode_config = orig


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="also sweep decode launch configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not at.HAVE_TRITON:
        sys.exit("needs a CUDA device and triton")
    t0 = time.time()
    torch.manual_seed(0)
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  H={H} KVH={KVH} D={D} block={BLOCK} {DTYPE}"
    )
    decode_case(32, 1024)
    decode_case(256, 512)
    decode_case(1, 8192)
    decode_case(64, 2048)
    prefill_case(8, 512)
    prefill_case(1, 4096)
    mixed_case()
    write_kv_case(4096)
    reference_comparison()
    if args.sweep:
        sweep_decode()
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
