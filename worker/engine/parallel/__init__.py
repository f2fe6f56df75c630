"""Tensor parallelism: one model replica spread over the GPUs of one host (issue 27).

Modules (each owns what its docstring says):
- group.py: the replica's ranks. `launch_ranks(N, target, args)` spawns ranks 1..N-1 running
  `target(state, *args)` and returns rank 0's `RankGroup`; `ParallelState` (rank, world size, the
  forward group and the control group) is passed explicitly to everything that needs it; the
  collectives (`all_reduce`, `all_gather`, `gather_to_first`) are no-ops at world size 1. A helper
  that dies ends the group with a `RankFailure`; collectives are bounded by a timeout; a helper exits
  when rank 0's process goes away, so SIGTERM/SIGKILL/Ctrl-C on rank 0 stop every rank.
- messages.py: what rank 0 sends each step (`RunStep(step)`, `Shutdown()`) over a `ControlChannel`,
  `StepDriver` (rank 0) and `serve_forever` (the other ranks); a step is any frozen dataclass
  (`StepDescription`), run by a `StepRunner`.

How the ranks run (the worker is rank 0; `serve` is module-level so spawn can pickle it):

    def serve(state, model_path):                           # ranks 1..N-1
        serve_forever(state, Runner(model_path, state))     # until rank 0 sends Shutdown

    group = launch_ranks(N, serve, (model_path,), device_type="cuda", on_failure=stop_the_worker)
    driver = StepDriver(group, Runner(model_path, group.state))
    result = driver.run(step)     # every rank runs `step`; rank 0's result (its logits) comes back
    driver.shutdown()             # or a RankFailure from run(): the worker exits 1
- memory.py: the split of a dimension over the ranks (`shard_for`, `head_shard`, `vocab_shard`), weight bytes per
  rank at TP=N; `check_fits` refuses a load with the numbers.
The layers that hold a rank's part of each weight are layers/'s (used at every world size); the shard's loading is
models/'s (shard_model.py, shard_build.py); rank 0's engine and a helper's life are ranks.py's.
How a model file uses the layers (it does not change with the world size):

    class Attention(nn.Module):
        def __init__(self, cfg, state):
            self.qkv = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                         cfg.num_kv_heads, state, bias=cfg.qkv_bias, dtype=dtype)
            self.o = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, state)
        def forward(self, x, ...):
            q, k, v = self.qkv.split(self.qkv(x))  # this rank's heads only
            ... attention over self.qkv.heads.num_q_heads / num_kv_heads heads, this rank's KV cache ...
            return self.o(out)  # all-reduced: every rank has the full hidden state

    gate_up = MergedColumnParallelLinear(hidden, [inter, inter], state)  -> silu_mul (local)
    down = RowParallelLinear(inter, hidden, state)                         -> all-reduced
    embed = VocabParallelEmbedding(vocab, hidden, state)                  -> all-reduced
    lm_head = ParallelLMHead(vocab, hidden, state)                         -> logits on rank 0 only

    loading: ckpt = SafetensorsCheckpoint.from_dir(path)
             attn.qkv.load_qkv(ckpt, f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj")
             mlp.gate_up.load_merged(ckpt, [f"{p}.gate_proj", f"{p}.up_proj"]); attn.o.load_from(ckpt, f"{p}.o_proj")

Norms, rotary tables and per-head q/k norms are replicated (plain tensors); attention sinks and q/k norms over
the whole projection (OLMo 2, whose statistic `TensorParallel.mean_square` sums over the ranks) hold the rank's
heads' entries. Everything between a column layer and the row layer after it (rotary, attention, SiLU·mul) is
local to the rank's heads/features, so the existing kernels run unchanged on smaller shapes. Each rank sizes its
own KV cache for its `num_kv_heads` heads from its own free memory.

Wired (ranks.py, models/shard_model.py): `--tensor-parallel-size N` / `EngineConfig.tensor_parallel_size` makes
`Engine.from_model` call `ranks.build_sharded_engine`: rank 0 spawns ranks 1..N-1 (`serve_rank`), every rank
builds its shard model (`models/shard_model.load_shard`: the family's transformers model at the rank's sizes, its
parameters views of the layers above, loaded by slice), the ranks agree on the KV blocks, and rank 0's
`ModelRunner` (its `Replica` the data that says so) sends each step's `StepDescription` before running it. The
owned decoder reads its part of the model as a `Shard` (layers/tensor_parallel.py: `TensorParallel.embed`,
`row_parallel_out`, `full_logits`, and `mean_square`; `WholeModel` at TP=1, where nothing here is built).

Sharded families: every family the owned decoder runs. Fused q/k/v and gate/up checkpoints (Phi-3/4, GLM-4) are
read block by block; the experts of Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss are split by intermediate size
(the router replicated, a down bias on rank 0 only); gpt-oss's MXFP4 release is dequantized at load (and at TP=1:
the one-process loader reads it as the one rank of a world of one, `shard_build.load_whole_model`). An FP8 KV
cache (--kv-cache-dtype fp8) holds each rank's own KV heads, with one process's static scales (1.0).

FP8 runs through the parallel linears' methods (quant/methods.py, `LinearMethods.method_for`), which read each
rank's slices with their scales; on a mixture of experts what is under a sparse MLP stays in the model dtype, the
experts dequantized by layers/experts.py, as one process loads them.

Not yet: CUDA-graph capture of the all-reduce (graphs are off at N > 1), a row-parallel linear's per-token
activation scale over the whole row (each rank's slice's, as in vLLM), decoder
'hf' and the families it alone runs (Cohere 2's parallel blocks); each is refused in one line
(`shard_model.unsupported_reason`, `load_shard`).
"""
