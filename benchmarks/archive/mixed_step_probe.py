"""Where a W2-like mixed step (Llama-3-8B shape, bf16, random weights) could go faster on the H200, if anywhere.

    python3 benchmarks/mixed_step_probe.py [--decodes 512] [--prefill 512] [--prefill 256 ...]

One mixed step of the owned decoder, eager as the engine runs it (decode rows first at contexts uniform in
150-1,600, then the prefill chunks), against:
  - its two halves alone: the decode rows (attention reads the KV cache: memory-bound) and the prefill
    chunks (GEMMs: compute-bound), the sum and the max of which bound what overlapping them could give;
  - the halves on two CUDA streams, layer by layer (the hardware may run one's attention beside the other's
    GEMMs), and GEMMs/attention on separate streams with the halves interleaved;
  - the same with the streams in green contexts (SM partitions), where torch has them;
  - each projection multiplied by a [K, N] copy of its weight (another cuBLAS kernel family), cuBLASLt
    preferred over cuBLAS, and a CUDA-graph replay of the whole step (the most a mixed-step graph could save).
Medians of CUDA-event times. Results: benchmarks/archive/HISTORY.md, "Mixed steps: what does not pay".
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from worker.engine.attention_backend import AttentionMetadata, TritonAttentionBackend  # noqa: E402
from worker.engine.decoder import OwnedDecoder  # noqa: E402
from worker.engine.models import load_model  # noqa: E402

BLOCK = 16


class Probe:
    def __init__(self, num_decodes: int, prefill: list[int]):
        self.dev = torch.device("cuda")
        model, _ = load_model("llama3-8b", self.dev, torch.bfloat16)
        self.dec = OwnedDecoder(model, 8192, use_triton=True)
        torch.cuda.empty_cache()
        rng = random.Random(0)
        ctx = [rng.randint(150, 1600) for _ in range(num_decodes)]
        self.seqs = [(c, 1) for c in ctx] + [(q, q) for q in prefill]  # (context incl. this step, query rows)
        num_blocks = sum(-(-c // BLOCK) for c, _ in self.seqs) + 1
        print(f"{num_decodes} decode rows (mean context {sum(ctx) / max(1, len(ctx)):.0f}), prefill {prefill}")
        cfg = model.config
        shape = (num_blocks, BLOCK, cfg.num_key_value_heads, self.dec.head_dim)
        self.kv = [
            tuple(torch.randn(shape, device=self.dev, dtype=torch.bfloat16) * 0.1 for _kv in range(2))
            for _ in range(cfg.num_hidden_layers)
        ]
        perm = (torch.randperm(num_blocks - 1) + 1).tolist()  # block 0 is the scratch block
        self.tables, start = [], 0
        for c, _ in self.seqs:
            n = -(-c // BLOCK)
            self.tables.append(perm[start : start + n])
            start += n
        self.backend = TritonAttentionBackend()
        self.kn: dict[int, torch.Tensor] = {}

    def batch(self, idx: list[int]):
        """(input_ids, positions, metadata, logits rows) of the sequences `idx` (decode rows first)."""
        sub, tabs = [self.seqs[i] for i in idx], [self.tables[i] for i in idx]
        tables = torch.zeros(len(idx), max(len(t) for t in tabs), dtype=torch.int32)
        cu, pos, slots = [0], [], []
        for row, ((c, q), t) in enumerate(zip(sub, tabs, strict=True)):
            tables[row, : len(t)] = torch.tensor(t)
            cu.append(cu[-1] + q)
            pos += range(c - q, c)
            slots += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(c - q, c)]
        nd = sum(q == 1 for _, q in sub)
        i32 = dict(dtype=torch.int32, device=self.dev)
        attn = AttentionMetadata(
            kv_caches=self.kv,
            slot_mapping=torch.tensor(slots, device=self.dev),
            block_tables=tables.to(self.dev),
            cu_seqlens_q=torch.tensor(cu, **i32),
            context_lens=torch.tensor([c for c, _ in sub], **i32),
            max_query_len=max(q for _, q in sub),
            max_context_len=max(c for c, _ in sub),
            is_decode_only=nd == len(sub),
            backend=self.backend,
            num_decode_seqs=nd,
        )
        rows = list(range(nd)) + [cu[nd + j + 1] - 1 for j in range(len(sub) - nd)]
        ids = torch.randint(0, 32000, (cu[-1],), device=self.dev)
        return ids, torch.tensor(pos, device=self.dev), attn, torch.tensor(rows, device=self.dev)

    def layers(self, batch, ops=None):
        """OwnedDecoder.__call__ as a generator that stops before and after each layer's attention."""
        dec, ops = self.dec, ops or self.dec.ops
        input_ids, positions, attn, rows = batch
        hidden, residual = F.embedding(input_ids, dec.embed_weight), None
        for idx, w in enumerate(dec.layers):
            k_cache, v_cache = attn.kv_caches[idx]
            normed, residual = ops.add_norm(hidden, residual, w.attn_in_norm, dec.eps)
            q = dec._qkv_rope_write(normed, positions, w, k_cache, v_cache, attn, ops)  # QKV GEMM, rotary, KV write
            yield
            out = attn.backend.attend(q, k_cache, v_cache, attn, dec.args.attention_scale, idx)
            yield
            hidden = ops.linear(out.view(out.shape[0], -1), w.o_weight, w.o_bias)
            normed, residual = ops.add_norm(hidden, residual, w.mlp_in_norm, dec.eps)
            activated = ops.gate_up_act(normed, w.gate_up_weight, w.gate_up_bias)
            hidden = ops.linear(activated, w.down_weight, w.down_bias)
        normed, _ = ops.add_norm(hidden[rows], residual[rows], dec.final_norm, dec.eps)
        ops.linear(normed, dec.lm_head, None)

    def serial(self, batches, ops=None) -> None:
        for b in batches:
            for _ in self.layers(b, ops):
                pass

    def two_streams(self, batches, streams) -> None:
        """Each batch on its own stream, launched layer by layer in turn."""
        main = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(main)
        gens = [self.layers(b) for b in batches]
        live = list(range(len(gens)))
        while live:
            for i in list(live):
                with torch.cuda.stream(streams[i]):
                    if next(gens[i], StopIteration) is StopIteration:
                        live.remove(i)
        for s in streams:
            main.wait_stream(s)

    def by_op(self, batches, gemm_stream, attn_stream) -> None:
        """GEMMs and element-wise kernels on one stream, attention on another, the batches interleaved."""
        main = torch.cuda.current_stream()
        gemm_stream.wait_stream(main)
        attn_stream.wait_stream(main)
        gens, live = [self.layers(b) for b in batches], set(range(len(batches)))
        while live:
            for i, g in enumerate(gens):
                if i not in live:
                    continue
                with torch.cuda.stream(gemm_stream):
                    if next(g, StopIteration) is StopIteration:
                        live.discard(i)
                        continue
                attn_stream.wait_stream(gemm_stream)
                with torch.cuda.stream(attn_stream):
                    next(g)
                gemm_stream.wait_stream(attn_stream)
        main.wait_stream(gemm_stream)
        main.wait_stream(attn_stream)

    def kn_ops(self, names: tuple[str, ...]):
        """Ops that multiply the projections `names` by a [K, N] copy of their weight."""
        self.kn = {}
        torch.cuda.empty_cache()
        for w in self.dec.layers:
            for name in names:
                t = getattr(w, f"{name}_weight")
                self.kn[t.data_ptr()] = t.t().contiguous()

        def linear(x, weight, bias):
            t = self.kn.get(weight.data_ptr())
            return F.linear(x, weight, bias) if t is None else torch.mm(x, t)

        base = self.dec.ops
        if "gate_up" in names:  # the large-step path: the GEMM, then silu_mul
            from worker.engine.layer_ops import gate_up_then_act
            from worker.engine.kernels import fused as fk

            return dataclasses.replace(base, linear=linear, gate_up_act=gate_up_then_act(linear, fk.silu_mul))
        return dataclasses.replace(base, linear=linear)


def timed(label: str, fn, iters: int = 8) -> float:
    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    print(f"{label:64s} {ms:8.2f} ms", flush=True)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, default=512)
    parser.add_argument("--prefill", type=int, action="append", help="prefill chunk lengths (default 512)")
    args = parser.parse_args()
    p = Probe(args.decodes, args.prefill or [512])
    n = len(p.seqs)
    full = p.batch(list(range(n)))
    decodes, prefills = p.batch(list(range(args.decodes))), p.batch(list(range(args.decodes, n)))
    timed("the mixed step, eager (the engine)", lambda: p.serial([full]))
    timed("  its decode rows alone", lambda: p.serial([decodes]))
    timed("  its prefill chunks alone", lambda: p.serial([prefills]))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    timed("decode rows and prefill chunks on two streams", lambda: p.two_streams([decodes, prefills], [s1, s2]))
    timed("GEMMs and attention on two streams", lambda: p.by_op([decodes, prefills], s1, s2))
    try:
        from torch.cuda.green_contexts import GreenContext

        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        for attn_sms in (num_sms // 2, num_sms // 4):
            contexts = [GreenContext.create(num_sms=k, device_id=0) for k in (num_sms - attn_sms, attn_sms)]
            g1, g2 = (c.Stream() for c in contexts)
            timed(
                f"green contexts: decode rows on {num_sms - attn_sms} SMs, prefill on {attn_sms}",
                lambda g1=g1, g2=g2: p.two_streams([decodes, prefills], [g1, g2]),
            )
            timed(
                f"green contexts: GEMMs on {num_sms - attn_sms} SMs, attention on {attn_sms}",
                lambda g1=g1, g2=g2: p.by_op([decodes, prefills], g1, g2),
            )
    except Exception as exc:  # noqa: BLE001 - an older torch or driver: report, go on
        print(f"green contexts: {type(exc).__name__}: {exc}")
    for names in (("qkv",), ("o",), ("gate_up",), ("down",)):
        ops = p.kn_ops(names)
        timed(f"the mixed step, {'+'.join(names)} weight as [K, N]", lambda ops=ops: p.serial([full], ops))
    p.kn = {}
    torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    timed("the mixed step, cuBLASLt preferred", lambda: p.serial([full]))
    torch.backends.cuda.preferred_blas_library("cublas")
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            p.serial([full])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            p.serial([full])
    timed("the mixed step, replayed from one CUDA graph", graph.replay)
    timed("the mixed step, eager, again (drift)", lambda: p.serial([full]))


if __name__ == "__main__":
    main()
