#!/usr/bin/env bash
# One call on the H200 (via the device tool) runs the GPU tests and the benchmarks:
#   bash benchmarks/run_gpu.sh [enginetests] [suite] [testsA] [testsB] [testsC] [testsD] [testsE] [testsF] [moetests] [longropetests] [dettests] [familytests] [w1moe] [w2moe] [w1moefp8] [w1gptoss] [w2gptoss] [w1glm] [w2glm] [mlatests] [mlagpu] [visiongpu] [w1mla] [w2mla] [w1mlaowned] [mlaprofilew2] [families] [w1families] [w2families] [tests] [kernels] [sweeps] [chain] [w1] [w1nocache] [w3] [w4] [w1hf] [w2] [w2hf] [queue] [w2grammar] [w2det] [w1det] [invsweep] [fp8tests] [fp8quality] [w1fp8] [w2fp8] [fp8steptests] [fp8stepgemm] [fp8split] [fp8all] [int4tests] [w1fp8step] [tp1w1] [tp1w2] [fp8profile] [fp8profilew2] [int4gemm] [w1int4] [w2int4] [w5] [trace] [w7] [w7bert] [embedtests] [w6] [w6encoder] [savecache]
# (no argument: all but enginetests, which `tests` includes, sweeps, and w2grammar: W2 async plain vs every request
# constrained to a small JSON schema vs top_logprobs 5, in one process, about 6 minutes; w2det/w1det: deterministic
# vs default mode, async, one process each; fp8tests/fp8quality/w1fp8/w2fp8: issue 26's FP8 KV kernel and engine
# tests, FP8 quality (KL, top-1) and FP8 weights + KV vs bf16 in one process; fp8steptests/fp8stepgemm/w1fp8step: the
# FP8 small-step GEMM's GPU tests, its microbenchmark and W1_fp8 with decode_gemm cublas vs triton; int4tests/w1int4/
# w2int4/int4gemm: issue 46's W4A16 kernel and INT4 decoder GPU tests, W1/W2 with packed INT4 weights vs bf16 in one
# process, the W4A16 GEMM microbenchmark and tile sweep). About 15 minutes in all on the H200:
# split it over two calls of the device tool, e.g. `tests kernels w1 w1hf` then `w2 w2hf queue`.
# Wheels for packages the H200 image lacks are carried in .whl/, Redis packages in .gpu/redis/
# (see benchmarks/README.md). Results and logs go to $OUT (the device tool) or benchmarks/out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# .whl-st/: sentence-transformers and what it imports (W7 and the embedding GPU tests only; ~47 MB, so a call that
# carries a Triton cache in parts leaves it behind: the device tool carries 64 MiB)
wheels=()
for wheel in .whl/*.whl .whl-st/*.whl; do [[ -f $wheel ]] && wheels+=("$wheel"); done
if (( ${#wheels[@]} )); then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stages=${*:-tests kernels w1 w1hf w2 w2hf queue}
has() { [[ " $stages " == *" $1 "* ]]; }
# Triton's compiled kernels across device calls: every call starts on a bare machine and the GPU suite compiles
# hundreds of kernel variants. A cache carried in as .gpu/triton-cache.tar.xz is unpacked first (entries are keyed
# by source, options, Triton version and GPU, so a changed kernel just misses); the `savecache` stage packs the
# cache into $OUT when it fits what the device tool brings back (16 MiB), to be copied to .gpu/ for the next call.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
# A pack over 15 MB comes back from `savecache` in parts (triton-cache.tar.xz.part-00, -01, ...), each under the
# device tool's 16 MiB a file; carried in, they are joined in their order.
cache_parts=(.gpu/triton-cache.tar.xz .gpu/triton-cache.tar.xz.part-*)
if [[ -f ${cache_parts[0]} ]]; then cache_parts=("${cache_parts[0]}"); else cache_parts=("${cache_parts[@]:1}"); fi
if [[ -f ${cache_parts[0]:-} ]]; then
    cat "${cache_parts[@]}" | tar -xJf - -C "$TRITON_CACHE_DIR" \
        && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries carried in (${#cache_parts[@]} file(s))"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"

bench() { timeout "$1" python3 -m worker.bench engine "${@:2}"; }

if has enginetests; then
    timeout 420 python3 -m pytest -q -m gpu tests/worker/engine/test_engine_gpu.py -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -25
fi
if has dettests; then  # issue 32: deterministic mode's GPU tests alone, -s for the default mode's agreement report
    timeout 420 python3 -m pytest -q -s -m gpu tests/worker/engine/test_deterministic_gpu.py \
        tests/worker/engine/test_deterministic_kernels.py -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_deterministic_tests.log" | tail -25
fi
if has tests; then
    timeout "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest -q -m gpu tests/worker/engine -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
# The whole suite outgrew one device call (10 minutes): testsA (the engine's core CUDA files), testsD (mixed
# attention, penalties, constrained decoding: A held them until A took 549 s of its 560 on 2026-12-01), testsB
# (families, MoE, deterministic) and testsC (everything else: FP8, tensor parallel, scoring, longrope), one call
# each or two groups to a call where they fit; testsE holds the MoE files. A file is in exactly one of them: C is what A, B, D and E leave.
# --durations=15 prints the slowest tests, for the next split.
CORE_GPU_TESTS="tests/worker/engine/test_engine_gpu.py tests/worker/engine/test_decoder_gpu.py
    tests/worker/engine/test_attention_triton.py tests/worker/engine/test_fused_kernels.py"
D_GPU_TESTS="tests/worker/engine/test_mixed_attention.py tests/worker/engine/test_penalties.py
    tests/worker/engine/test_constrained_gpu.py"
B_GPU_TESTS="tests/worker/engine/test_family_kernels.py tests/worker/engine/test_deterministic_gpu.py
    tests/worker/engine/test_deterministic_kernels.py"
# testsE: the MoE files, out of testsB since a cold start cut B at 560 s after 23 tests (2026-12-01f)
E_GPU_TESTS="tests/worker/engine/test_engine_moe_gpu.py tests/worker/engine/test_moe_triton.py"
# testsF: latent attention (issue 47) and images (issue 50), out of testsC since they doubled its length
F_GPU_TESTS="tests/worker/engine/test_engine_deepseek_gpu.py tests/worker/engine/test_latent_fp8.py
    tests/worker/engine/test_latent_prefill.py tests/worker/engine/test_latent_attention.py
    tests/worker/engine/test_engine_vision_gpu.py tests/worker/engine/test_engine_gemma3_vision_gpu.py
    tests/worker/engine/test_engine_mistral3_vision_gpu.py tests/worker/engine/test_vision_attention.py"
# testsC: every other GPU test file
C_IGNORES=$(for f in $CORE_GPU_TESTS $B_GPU_TESTS $D_GPU_TESTS $E_GPU_TESTS $F_GPU_TESTS; do printf -- '--ignore=%s ' "$f"; done)
if has testsA; then
    # shellcheck disable=SC2086  # the list is word-split on purpose
    timeout "${GPU_TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu $CORE_GPU_TESTS -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests_a.log" | tail -25
fi
if has testsD; then
    # shellcheck disable=SC2086
    timeout "${GPU_TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu $D_GPU_TESTS -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests_d.log" | tail -25
fi
if has testsB; then
    # shellcheck disable=SC2086
    timeout "${GPU_TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu $B_GPU_TESTS -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests_b.log" | tail -25
fi
if has testsE; then
    # shellcheck disable=SC2086
    timeout "${GPU_TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu $E_GPU_TESTS -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests_e.log" | tail -25
fi
if has testsF; then
    # shellcheck disable=SC2086
    timeout "${GPU_TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu $F_GPU_TESTS -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests_f.log" | tail -25
fi
if has testsC; then
    # shellcheck disable=SC2086
    timeout "${GPU_TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu tests/worker/engine $C_IGNORES -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests_c.log" | tail -25
fi
if has suite; then  # the whole gpu suite, its five groups side by side on the one GPU (each process capped at a share
    # of its memory: tests/conftest.py CBQ_TEST_GPU_SHARE); Triton's compiles, most of a group's time, take a core each
    groups=(A B C D E F) pids=()
    # testsC's FP8, INT4 and MoE kernel tests hold two engines or GBs of reference experts at once: on an H100 (79 GiB)
    # they ran out of memory at 0.15 (2026-12-06); each engine also keeps 6 GiB for activations out of its share
    declare -A shares=([A]=0.125 [B]=0.125 [C]=0.28 [D]=0.125 [E]=0.125 [F]=0.125)
    for group in "${groups[@]}"; do
        case $group in
            A) files=$CORE_GPU_TESTS ;; B) files=$B_GPU_TESTS ;; D) files=$D_GPU_TESTS ;; E) files=$E_GPU_TESTS ;; F) files=$F_GPU_TESTS ;;
            C) files="tests/worker/engine $C_IGNORES" ;;
        esac
        # shellcheck disable=SC2086
        CBQ_TEST_GPU_SHARE=${GPU_SUITE_SHARE:-${shares[$group]}} timeout "${GPU_TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu $files \
            -p no:cacheprovider --durations=15 >"$OUT/gpu_suite_$group.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do wait "${pids[$i]}"; echo "group ${groups[$i]}: exit $?"; done
    for group in "${groups[@]}"; do echo "== $group"; grep -E "passed|failed|error|skipped" "$OUT/gpu_suite_$group.log" | tail -n 3; done
fi
if has moetests; then  # the MoE families on CUDA (owned decoder vs generate in fp32, graphs vs eager) and the MoE kernels
    timeout 420 python3 -m pytest -q -m gpu tests/worker/engine/test_engine_moe_gpu.py tests/worker/engine/test_moe_triton.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_moe_tests.log" | tail -25
fi
if has longropetests; then  # phi3's longrope (testsC runs them too): Triton path on long rows, fp32 owned vs generate
    timeout 420 python3 -m pytest -q -m gpu tests/worker/engine/test_longrope.py -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_longrope_tests.log" | tail -25
fi
if has kernels; then
    timeout 120 python3 benchmarks/gpu_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -20
fi
if has sweeps; then  # launch-configuration sweeps: decode attention, and the decode-shaped GEMMs (about 2 minutes)
    timeout 150 python3 benchmarks/gpu_kernels.py --sweep 2>&1 | tee "$OUT/decode_attention_sweep.log" | tail -12
    timeout 150 python3 benchmarks/skinny_gemm.py --m 32 --m 64 --sweep 2>&1 | tee "$OUT/skinny_gemm_sweep.log" | grep -v "^    "
fi
if has chain; then  # the decoder layer's GEMM chain at M = 32: cuBLAS vs decode_gemm.py's Triton GEMMs, with and without PDL
    timeout 150 python3 benchmarks/skinny_gemm.py --chain --m 32 2>&1 | tee "$OUT/gemm_chain.log"
fi
if has w1; then  # with the small-step path (decode_gemm triton, the default) and without it, both modes, and
    # transformers' generate_batch (128 new tokens per request), one process.
    # The first run of a process is slower in sync mode (seen on the H200, cause unknown): cuBLAS goes first and absorbs it.
    bench 300 --model llama3-8b --workload W1 --mode both --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --decode-gemm cublas --decode-gemm triton --compare-hf --hf-output-len 128 --json-out "$OUT/w1.json" 2>&1 | tail -14
fi
if has w1nocache; then  # the prefix cache's cost on a workload with nothing to share (issue 12: <= 2%)
    bench 150 --model llama3-8b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 --no-prefix-caching \
        --json-out "$OUT/w1_nocache.json" 2>&1 | tail -6
fi
if has w3; then  # 1,000 requests behind one 2,000-token prefix: prefix caching on vs off
    bench 120 --model llama3-8b --workload W3 --mode async --json-out "$OUT/w3_on.json" 2>&1 | tail -6
    bench 200 --model llama3-8b --workload W3 --mode async --no-prefix-caching --json-out "$OUT/w3_off.json" 2>&1 | tail -6
fi
if has w4; then  # 256 prompts x n = 8 samples vs the same 2,048 requests sent separately, caching off
    bench 150 --model llama3-8b --workload W4 --mode async --json-out "$OUT/w4_on.json" 2>&1 | tail -6
    bench 200 --model llama3-8b --workload W4 --mode async --no-prefix-caching --json-out "$OUT/w4_off.json" 2>&1 | tail -6
fi
if has w1hf; then
    bench 400 --model llama3-8b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 --compare-hf --hf-output-len 128 \
        --json-out "$OUT/w1_hf.json" 2>&1 | tail -12
fi
if has w2; then
    bench 480 --model llama3-8b --workload W2 --mode both --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --json-out "$OUT/w2.json" 2>&1 | tail -12
fi
# Issue 25, random bf16 weights: w1moe/w2moe the Qwen3-30B-A3B shape (W1_moe, W2_moe), w1gptoss/w2gptoss the
# gpt-oss-20b shape (W1_gptoss, W2_gptoss); one stage each, since two of them outgrow one device call. w1moe and
# w2moe run Llama-3-8B first in the same process, the issue's reference beside them (results.json
# llama3_8b_same_call).
if has w1moe; then
    bench 420 --model llama3-8b --model qwen3-30b-a3b --workload W1 --mode async --max-num-seqs 32 \
        --max-num-batched-tokens 2048 --json-out "$OUT/w1_moe.json" 2>&1 | tail -8
fi
if has w1moefp8; then  # issue 26: Qwen3-30B-A3B shape with FP8 weights, experts and KV vs bf16, one process (moe/triton_fp8.py)
    bench 540 --model qwen3-30b-a3b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --precision bf16 --precision fp8 --json-out "$OUT/w1_moe_fp8.json" 2>&1 | tail -8
fi
if has w1gptoss; then
    bench 420 --model gptoss-20b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --json-out "$OUT/w1_gptoss.json" 2>&1 | tail -8
fi
if has w1glm; then  # GLM-4.5-Air's layer shape (grouped sigmoid routing, a shared expert), its first 23 layers (106 GB)
    bench 480 --model glm45-air-23l --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --json-out "$OUT/w1_glm45air.json" 2>&1 | tail -8
fi
if has w2glm; then
    bench 540 --model glm45-air-23l --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --json-out "$OUT/w2_glm45air.json" 2>&1 | tail -8
fi
if has w2moe; then
    bench 540 --model llama3-8b --model qwen3-30b-a3b --workload W2 --mode async --max-num-seqs 1024 \
        --max-num-batched-tokens 8192 --json-out "$OUT/w2_moe.json" 2>&1 | tail -8
fi
if has w2gptoss; then
    bench 540 --model gptoss-20b --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --json-out "$OUT/w2_gptoss.json" 2>&1 | tail -8
fi
# Issue 47, random bf16 weights: the DeepSeek-V2-Lite and Moonlight-16B-A3B shapes (multi-head latent attention over
# the paged latent cache, latent_attention.py; floors from the latent's bytes and the active experts) beside
# Llama-3-8B in one process (W1_mla, W2_mla); mlatests: their CPU exactness tests (TP=2 over gloo included) and the
# latent shapes' kernels;
# mlagpu: their GPU tests.
if has mlatests; then
    timeout 540 python3 -m pytest -q tests/worker/engine/test_engine_exact_deepseek.py tests/worker/engine/test_latent_attention.py \
        tests/worker/engine/test_deepseek_shapes.py tests/worker/engine/test_parallel_latent_attention.py \
        tests/worker/engine/test_latent_fp8.py -p no:cacheprovider 2>&1 | tee "$OUT/mla_tests.log" | tail -25
fi
if has mlagpu; then  # the latent path on CUDA, "auto" and "owned": fp32 vs generate on both fixtures, bf16 graph
    # vs eager; TP=2 over gloo, the FP8 latent cache (vs bf16, twice the blocks; the latent kernel over e4m3)
    timeout 540 python3 -m pytest -q -s -m gpu tests/worker/engine/test_engine_deepseek_gpu.py tests/worker/engine/test_latent_fp8.py \
        -p no:cacheprovider 2>&1 \
        | tee "$OUT/mla_gpu_tests.log" | tail -25
fi
if has visiongpu; then  # issue 50: the vision-language families on CUDA (fp32 vs generate, sync/async, graphs)
    timeout "${VISION_TESTS_TIMEOUT:-400}" python3 -m pytest -q -m gpu tests/worker/engine/test_engine_vision_gpu.py \
        tests/worker/engine/test_engine_gemma3_vision_gpu.py \
        tests/worker/engine/test_engine_mistral3_vision_gpu.py tests/worker/engine/test_vision_attention.py \
        -p no:cacheprovider --durations=8 2>&1 \
        | tee "$OUT/vision_gpu_tests.log" | tail -25
fi
if has w1mla; then
    bench 540 --model llama3-8b --model deepseek-v2-lite --model moonlight-16b-a3b --workload W1 --mode async \
        --max-num-seqs 32 --max-num-batched-tokens 2048 --max-model-len 8192 --json-out "$OUT/w1_mla.json" 2>&1 | tail -12
fi
if has w2mla; then
    bench 590 --model llama3-8b --model deepseek-v2-lite --model moonlight-16b-a3b --workload W2 --mode async \
        --max-num-seqs 1024 --max-num-batched-tokens 8192 --max-model-len 8192 --json-out "$OUT/w2_mla.json" 2>&1 | tail -12
fi
if has mlaprefill; then  # issue 47 item 5: W2 on the DeepSeek-V2-Lite shape, latent attention's prefill absorbed (before)
    # and each step's cheaper of absorbed and expanded K/V (latent_prefill.py, "auto": after), in one process
    bench 590 --model deepseek-v2-lite --mla-prefill absorbed --mla-prefill auto --workload W2 --mode async \
        --max-num-seqs 1024 --max-num-batched-tokens 8192 --max-model-len 8192 --json-out "$OUT/w2_mla_prefill.json" 2>&1 | tail -12
fi
if has mlaprofilew2; then  # issue 47 item 5: W2's steps on the DeepSeek-V2-Lite shape per kernel (owned decoder): what holds
    # its floor ratio at 0.55 (its 8,192-token mixed steps took 131 ms where their FLOPs need about 65)
    timeout 400 python3 benchmarks/profile_step.py --model deepseek-v2-lite --workload w2 --decoder owned \
        --out "$OUT/profile_w2_mla.txt" 2>&1 | tail -40
fi
if has w1mlaowned; then  # issue 47 item 5: W1 on the DeepSeek-V2-Lite shape, "auto" and the owned decoder (latent_layer.py,
    # the owned MoE path), in one process (W1_mla_owned). Measured at daeb512 (2026-12-06, H100), "auto" was then
    # transformers' layers with cbq's latent attention: owned 1.36x, and "auto" takes the owned decoder on CUDA since,
    # so the two now run the same path (the stage checks that they still measure alike)
    bench 540 --model deepseek-v2-lite --decoder auto --decoder owned --workload W1 --mode async \
        --max-num-seqs 32 --max-num-batched-tokens 2048 --max-model-len 8192 --json-out "$OUT/w1_mla_owned.json" 2>&1 | tail -12
fi
if has families || has w1families; then  # issue 24: the Gemma 3 12B and Phi-4 14B shapes against Llama-3-8B (floor
    # ratios within 10%), async, the three models in one process per workload (W1_gemma3, W1_phi4; about 2 minutes)
    bench 240 --model llama3-8b --model gemma3-12b --model phi4-14b --workload W1 --mode async --max-num-seqs 32 \
        --max-num-batched-tokens 2048 --max-model-len 8192 --json-out "$OUT/w1_families.json" 2>&1 | tail -12
fi
if has families || has w2families; then  # W2_gemma3, W2_phi4: about 6 minutes
    bench 480 --model llama3-8b --model gemma3-12b --model phi4-14b --workload W2 --mode async --max-num-seqs 1024 \
        --max-num-batched-tokens 8192 --max-model-len 8192 --json-out "$OUT/w2_families.json" 2>&1 | tail -12
fi
if has familytests; then  # issue 24: the families on the owned decoder's Triton path (kernels, fp32 vs generate, graphs)
    timeout 420 python3 -m pytest -q -m gpu tests/worker/engine/test_family_kernels.py tests/worker/engine/test_fused_kernels.py \
        tests/worker/engine/test_attention_triton.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_family_tests.log" | tail -25
fi
if has w2grammar; then
    bench 590 --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --variant plain --variant json --variant logprobs5 --json-out "$OUT/w2_grammar.json" 2>&1 | tail -12
fi
if has w2det; then  # issue 32: deterministic (batch-invariant) vs default mode, async, one process
    bench 590 --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --deterministic --json-out "$OUT/w2_deterministic.json" 2>&1 | tail -12
fi
if has invsweep; then  # issue 32: deterministic mode's one GEMM configuration for every M, chosen by measurement
    timeout 300 python3 benchmarks/invariant_gemm_sweep.py --json-out "$OUT/invariant_gemm_sweep.json" 2>&1 | tee "$OUT/invariant_gemm_sweep.log" | tail -40
fi
if has w1det; then
    bench 400 --model llama3-8b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --deterministic --json-out "$OUT/w1_deterministic.json" 2>&1 | tail -12
fi
if has fp8tests; then  # issue 26: the FP8 KV cache's kernels (vs the torch reference) and engine (vs a bf16 cache)
    timeout 420 python3 -m pytest -q -s -m gpu tests/worker/engine/test_attention_fp8_kv.py tests/worker/engine/test_kv_cache_fp8.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_fp8_kv_tests.log" | tail -25
fi
if has fp8quality; then  # issue 26: teacher-forced KL and top-1 agreement, FP8 weights / KV / both vs bf16 (Llama-3-8B shape)
    timeout 300 python3 -m worker.bench quality --model llama3-8b --num-prompts 4 --prompt-len 512 --decode-len 32 \
        --json-out "$OUT/fp8_quality.json" 2>&1 | tail -8
fi
if has w1fp8; then  # issue 26: W1 with FP8 weights and KV vs bf16, async, one process (W1_fp8)
    bench 420 --model llama3-8b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --precision bf16 --precision fp8 --json-out "$OUT/w1_fp8.json" 2>&1 | tail -8
fi
if has fp8steptests; then  # issue 26: the FP8 small-step GEMM (quant/small_step.py) on CUDA, its decoder and engine opt-in
    timeout 300 python3 -m pytest -q -s -m gpu tests/worker/engine/test_quant_small_step.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_fp8_step_tests.log" | tail -25
fi
if has fp8stepgemm; then  # FP8 small-step kernel vs quantization + _scaled_mm vs the bf16 small-step kernel, M = 32
    timeout 200 python3 benchmarks/fp8_step_gemm.py --m 32 --sweep 2>&1 | tee "$OUT/fp8_step_gemm.log" | grep -v "^    "
    timeout 120 python3 benchmarks/fp8_step_gemm.py --chain --m 32 2>&1 | tee "$OUT/fp8_step_chain.log"
fi
if has fp8all; then  # issue 26: every FP8 GPU test file but the KV ones (fp8tests): quant kernels, decoder, small step, MoE experts
    timeout 480 python3 -m pytest -q -s -m gpu tests/worker/engine/test_quant_kernels.py tests/worker/engine/test_quant_decoder.py \
        tests/worker/engine/test_quant_small_step.py tests/worker/engine/test_moe_fp8.py tests/worker/engine/test_quant_moe.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_fp8_all_tests.log" | tail -30
fi
if has int4tests; then  # issue 46: INT4 checkpoints (GPTQ, AWQ gemm, pack-quantized) dequantized at load on CUDA, owned
    # decoder; the W4A16 GEMM (kernels/w4a16.py) at Llama-3-8B's shapes; packed INT4 weights in the owned decoder's graphs
    timeout 500 python3 -m pytest -q -s -m gpu tests/worker/engine/test_quant_int4.py tests/worker/engine/test_w4a16.py \
        tests/worker/engine/test_int4_decoder.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_int4_tests.log" | tail -25
fi
if has fp8split; then  # split-K (kernels/split_k.py): each FP8 projection at split 1/2/4, the layer chain with and without
    timeout 200 python3 benchmarks/fp8_step_gemm.py --m 32 2>&1 | tee "$OUT/fp8_split_gemm.log" | grep -v "^    "
    timeout 120 python3 benchmarks/fp8_step_gemm.py --chain --m 32 2>&1 | tee "$OUT/fp8_split_chain.log"
fi
if has actquant; then  # a large step's act·mul + per-token quantization (quant/kernels.py) per (BLOCK, num_warps)
    timeout 200 python3 benchmarks/act_mul_quant.py 2>&1 | tee "$OUT/act_mul_quant.log"
fi
if has w1fp8step; then  # W1_fp8 (FP8 weights and KV) with the FP8 small-step path (decode_gemm triton) vs without, one process
    bench 420 --model llama3-8b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --precision fp8 --decode-gemm cublas --decode-gemm triton --json-out "$OUT/w1_fp8_step.json" 2>&1 | tail -8
fi
if has int4gemm; then  # issue 46: the W4A16 GEMM vs bf16 and vs dequantize + cuBLAS per projection, and its tile sweep
    timeout 400 python3 benchmarks/w4a16_gemm.py --m 1 8 16 32 512 8192 2>&1 | tee "$OUT/w4a16_gemm.log"
    timeout 500 python3 benchmarks/w4a16_gemm.py --m 32 512 --sweep 2>&1 | tee "$OUT/w4a16_sweep.log" | grep -E "best|Error"
fi
if has w1int4; then  # issue 46: W1 with packed INT4 weights (W4A16, group 128, symmetric) vs bf16, async, one process
    bench 480 --model llama3-8b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --precision bf16 --precision int4 --json-out "$OUT/w1_int4.json" 2>&1 | tail -8
fi
if has w2int4; then  # W2_int4
    bench 590 --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --precision bf16 --precision int4 --json-out "$OUT/w2_int4.json" 2>&1 | tail -8
fi
if has fp8profile; then  # issue 26: per-kernel device time of W1's steps, bf16 vs FP8 weights + KV (the gap to W1_fp8's floor)
    timeout 300 python3 benchmarks/profile_step.py --workload w1 --precision bf16 --precision fp8 \
        --out "$OUT/profile_w1_fp8.txt" 2>&1 | tail -70
fi
if has fp8profilew2; then  # issue 26: the same for W2's steps (400 requests: mixed prefill + decode, 8,192-token steps)
    timeout 400 python3 benchmarks/profile_step.py --workload w2 --precision bf16 --precision fp8 \
        --out "$OUT/profile_w2_fp8.txt" 2>&1 | tail -70
fi
# Issue 49: w5, the MLPerf-shaped offline workload (2,000 requests, prompts N(780, 350) in 100-2,000, outputs 30-128)
# at bf16 and FP8 weights + KV in one process (W5_bf16, W5_fp8: about 1-2 minutes of generation per precision, plus
# each load and its 64-request warm-up); trace, W1 sync and async with each step's spans (w1_trace.json, a process
# per mode, for Perfetto) and device busy over time (w1_trace.png). Each says FAILED, and the call exits non-zero at
# the end, if its run fails, times out or writes no file.
failed=()
check_outputs() {  # stage, status of its run, files it must have written
    local stage=$1 status=$2 file
    shift 2
    for file in "$@"; do [[ -s $file ]] || status="${status:-0}, no $(basename "$file")"; done
    if [[ $status != 0 ]]; then echo "$stage: FAILED ($status)"; failed+=("$stage"); fi
}
if has w5; then
    rm -f "$OUT/w5.json"  # a file left from an earlier run must not pass for this one
    bench 540 --model llama3-8b --workload W5 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --precision bf16 --precision fp8 --json-out "$OUT/w5.json" 2>&1 | tail -8
    check_outputs w5 "${PIPESTATUS[0]}" "$OUT/w5.json"
fi
if has trace; then
    rm -f "$OUT"/w1_trace.json "$OUT"/w1_trace.png "$OUT"/w1_trace_results.json
    bench 300 --model llama3-8b --workload W1 --mode both --max-num-seqs 32 --max-num-batched-tokens 2048 \
        --trace "$OUT/w1_trace.json" --json-out "$OUT/w1_trace_results.json" 2>&1 | tail -8
    check_outputs trace "${PIPESTATUS[0]}" "$OUT/w1_trace.json" "$OUT/w1_trace.png" "$OUT/w1_trace_results.json"
fi
if has w2fp8; then  # W2_fp8
    bench 590 --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --precision bf16 --precision fp8 --json-out "$OUT/w2_fp8.json" 2>&1 | tail -8
fi
# Issue 27 item 6: TP=1 before and after tensor parallelism was wired into the engine (the parents of 3b6bd23 and
# 390d273), the two trees carried as .tp-before/ and .tp-after/ (benchmarks/README.md), run alternately in one call
# (before, after, before, after) so that neither gets the machine's warm-up alone.
tp1_runs() {  # workload, timeout, bench arguments...
    local out run=0 tree
    out=$(cd "$OUT" && pwd)
    for tree in .tp-before .tp-after .tp-before .tp-after; do
        run=$((run + 1))
        [[ -d $tree/worker ]] || { echo "tp1$1: $tree not carried"; return; }
        (cd "$tree" && PYTHONPATH=$PWD${PYTHONPATH#"$OLDPWD"} timeout "$2" python3 -m worker.bench engine "${@:3}" \
            --json-out "$out/tp1_$1_${tree#.tp-}_$run.json" 2>&1 | tail -4)
    done
}
if has tp1w1; then
    tp1_runs w1 200 --model llama3-8b --workload W1 --mode async --max-num-seqs 32 --max-num-batched-tokens 2048
fi
if has tp1w2; then
    tp1_runs w2 200 --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192
fi
if has queue; then
    bash .gpu/start-redis.sh .gpu/redis && timeout 400 python3 -m worker.bench e2e --model llama3-8b --workload W2 --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --json-out "$OUT/w2_queue.json" 2>&1 | tail -12
fi
if has w2hf; then
    # cbq async on the whole workload and transformers on its first 200 requests (256 new tokens), one process
    bench 420 --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 \
        --compare-hf --hf-num-requests 200 --hf-output-len 256 --json-out "$OUT/w2_hf.json" 2>&1 | tail -6
fi
python3 benchmarks/collect_results.py "$OUT" >/dev/null && cp benchmarks/results.json "$OUT/results.json"
# Issue 48 item 4: W7 (bulk embedding) through cbq's embedding engine vs sentence-transformers' encode(batch_size=256)
# in the same process, bf16. sentence-transformers and its imports (scikit-learn, scipy, joblib, threadpoolctl) come
# as wheels in .whl-st/. The 8B shape embeds about 100-200 inputs/s, so one call runs W7_NUM inputs (20,000 by default;
# 100,000 would outlast the 10-minute call) and sentence-transformers the first W7_REF_NUM; their rates are compared.
# The decoder shape runs cbq's packed forward (worker/embedding/packed.py) and, on the same first W7_REF_NUM inputs,
# cbq with transformers' padded forward (the engine before it): the table's "packed/hf" column.
if has w7; then
    timeout 580 python3 -m worker.bench embed --shape qwen3-embedding-8b --num "${W7_NUM:-20000}" \
        --reference-num "${W7_REF_NUM:-5000}" --json-out "$OUT/w7_qwen3_embedding_8b.json" 2>&1 | tail -6
fi
# Issue 46 item 3: load seconds, peak host RSS and peak GPU memory of the one loader (cbq) against transformers'
# from_pretrained (hf, the route before), each load in a fresh child process. load: Llama-3-8B in bf16 (16 GB written
# to /tmp once) and with --quantization fp8; load30b: the Qwen3-30B-A3B shape at half its depth (24 of 48 layers,
# ~31 GB), since the whole one (~61 GB) does not fit the device's disk. Two stages: each is several minutes.
if has load; then
    rm -f "$OUT"/load_llama3_8b*.json
    python3 benchmarks/load_model.py --preset llama3-8b --save-dir /tmp/ckpt/llama3-8b --routes cbq hf \
        --json "$OUT/load_llama3_8b.json" 2>&1 | tail -4
    python3 benchmarks/load_model.py --checkpoint /tmp/ckpt/llama3-8b --quantization fp8 --routes cbq \
        --json "$OUT/load_llama3_8b_fp8.json" 2>&1 | tail -3
    check_outputs load "${PIPESTATUS[0]}" "$OUT/load_llama3_8b.json" "$OUT/load_llama3_8b_fp8.json"
    rm -rf /tmp/ckpt/llama3-8b
fi
if has load30b; then
    rm -f "$OUT/load_qwen3_30b_a3b_24l.json"
    python3 benchmarks/load_model.py --preset qwen3-30b-a3b --override num_hidden_layers=24 \
        --save-dir /tmp/ckpt/qwen3-30b-a3b-24l --routes cbq hf --json "$OUT/load_qwen3_30b_a3b_24l.json" 2>&1 | tail -4
    check_outputs load30b "${PIPESTATUS[0]}" "$OUT/load_qwen3_30b_a3b_24l.json"
    rm -rf /tmp/ckpt/qwen3-30b-a3b-24l
fi
if has w7bert; then
    timeout 580 python3 -m worker.bench embed --shape bert-large --num "${W7_BERT_NUM:-100000}" \
        --json-out "$OUT/w7_bert_large.json" 2>&1 | tail -6
fi
if has embedtests; then  # the embedding engine on CUDA vs sentence-transformers, fp32 and bf16 (needs its wheels too)
    timeout 420 python3 -m pytest -q -m gpu tests/worker/embedding/test_engine_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_embed_tests.log" | tail -5
fi
# Issue 50 item 6: W6 (a 1024x768 picture and ~100 text tokens in, 256 tokens out, a request; 999 image tokens each)
# on the Qwen2.5-VL-7B shape, random bf16 weights built on the GPU: cbq as a worker feeds it vs transformers' generate
# on the first W6_HF_NUM requests (one left-padded batch), one process, with the vision encoder's share of cbq's run.
# About 1.1M prefill and 256k decode tokens at W6_NUM=1000 (estimated to fit the call; set W6_NUM=400 if it does not).
if has w6; then
    # transformers' layers ("hf", auto's choice for VLMs today) and the owned decoder, each an engine over the same
    # model, in one process: which one auto should take (decoder._auto_owned)
    timeout 560 python3 -m worker.bench vision --shape qwen2.5-vl-7b --num "${W6_NUM:-600}" --output-len 256 \
        --hf-num-requests "${W6_HF_NUM:-16}" --mode async --decoder hf --decoder owned \
        --json-out "$OUT/w6_qwen2_5_vl_7b.json" 2>&1 | tail -14
fi
# Issue 50 item 6, the encoder's share: Qwen2.5-VL-7B's vision tower alone (random bf16 weights, no language model)
# over 4 calls of 8 W6 pictures, transformers' sdpa (a call per window and image) vs cbq's packed attention (one
# call a block, worker/engine/models/vision_attention.py), one process; about a minute.
if has w6encoder; then
    rm -f "$OUT/w6_encoder.json"
    timeout 300 python3 -m worker.bench vision-encoder --shape qwen2.5-vl-7b --images 8 --batches 4 \
        --json-out "$OUT/w6_encoder.json" 2>&1 | tail -8
    check_outputs w6encoder "${PIPESTATUS[0]}" "$OUT/w6_encoder.json"
fi
if has savecache; then
    tar -C "$TRITON_CACHE_DIR" -cf - . | xz -T0 -6 > /tmp/triton-cache.tar.xz
    size=$(stat -c %s /tmp/triton-cache.tar.xz)
    if (( size <= 16000000 )); then
        cp /tmp/triton-cache.tar.xz "$OUT/"
    elif (( size <= 4 * 15000000 )); then  # in parts of 15 MB: at most 4 of the 8 files a call brings back
        split -b 15000000 -d /tmp/triton-cache.tar.xz "$OUT/triton-cache.tar.xz.part-"
        echo "triton cache: $size bytes packed, in $(ls "$OUT"/triton-cache.tar.xz.part-* | wc -l) parts"
    else
        echo "triton cache: $size bytes packed, more than the device tool brings back; not saved"
    fi
fi
ls -la "$OUT"
if (( ${#failed[@]} )); then echo "FAILED stages: ${failed[*]}"; exit 1; fi
