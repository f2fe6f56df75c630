"""`cbq bench vision`: W6, images in bulk, through cbq's engine and transformers' `generate` in one process.

W6 = N requests (default 1,000), each one picture of 1024x768 drawn here with Pillow (seeded, every request its own:
shapes, colours and words differ, so the encoder cache and the prefix cache never join two requests) and a chat
prompt of about 100 text tokens, each answered with 256 tokens (EOS ignored), on Qwen2.5-VL-7B-Instruct's shape
with random weights (qwen_vl_checkpoint.py: the model is built on the device in the model dtype, bf16 on CUDA;
config.json, the tokenizer and preprocessor_config.json are written to a temporary folder, no weights), or the
tests' tiny shape on the CPU.

transformers runs the first `--hf-num-requests` first (before the engine takes the device's memory for its KV
cache): their pictures through the checkpoint's image processor (worker/media/qwen_vl.py, as the engine's admission
does: the device has no torchvision, so never AutoProcessor), left-padded batches of `--hf-batch-size` into
`generate` on the same module (greedy, 256 new tokens, no EOS). cbq then runs every request as a worker feeds it
(the engine's loop thread started, requests added while it has capacity, each one's picture through the image
processor at admission, on the engine's admission threads, results collected as they come, after `--warmup`
requests of their own). Both rates include the image processing. The profile's "admission" is the time the
adding thread spent in `add_request` (9.6 s of W6's 29 s on the H100 when it processed each picture itself;
since the admission pool, worker/engine/admission.py, about the time to hand each request over).

The step profile: the vision encoder's device time over cbq's run (CUDA events around each tower call, kept by the
runner's `ImageEncoder.encode_seconds`) against the decoder's (the steps' device time less the encoder's), and its
share of the run's wall time. Issue 50's target: cbq >= 10x transformers' requests/s, encoder <= 25% of the run.
Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from worker.bench.common import compared_choice, eos_ignored, run_header, triton_compiles
from worker.bench.qwen_vl_checkpoint import QWEN2_5_VL_SHAPES, random_qwen2_5_vl
from worker.bench.tokenizer_files import corpus
from worker.engine.config import DECODERS

W6_IMAGE_SIZE = (1024, 768)  # width, height
WORKLOAD_W6 = {"num": 1000, "text_len": 100, "output_len": 256}
TARGET_RATIO = 10.0  # issue 50: cbq's requests/s over transformers'
TARGET_ENCODER_SHARE = 0.25  # issue 50: the vision encoder's share of the run
W6_INSTRUCTION = "Describe the picture, then read its words:"
WARMUP_SEED = 1_000_000  # the warm-up's pictures: never the measured ones (the encoder cache would hold them)


def w6_picture(seed: int, size: tuple[int, int] = W6_IMAGE_SIZE):
    """A seeded picture: a coloured background, shapes and a few lines of words, different for every seed."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    width, height = size

    def colour() -> tuple[int, int, int]:
        return (rng.randrange(256), rng.randrange(256), rng.randrange(256))

    image = Image.new("RGB", size, colour())
    draw = ImageDraw.Draw(image)
    for _ in range(24):
        x0, x1 = sorted(rng.randrange(width) for _ in range(2))
        y0, y1 = sorted(rng.randrange(height) for _ in range(2))
        shape = rng.choice(("rectangle", "ellipse", "line"))
        if shape == "line":
            draw.line((x0, y0, x1, y1), fill=colour(), width=rng.randint(1, 12))
        else:
            getattr(draw, shape)((x0, y0, x1, y1), fill=colour(), outline=colour())
    words = " ".join(corpus(6, seed)).split()
    for line in range(6):
        draw.text(
            (rng.randrange(width // 2), rng.randrange(height)),
            " ".join(words[line * 6 : line * 6 + 6]),
            fill=colour(),
        )
    return image


def w6_prompts(tokenizer, num: int, text_len: int, seed: int) -> list[list[int]]:
    """`num` chat prompts (the template's ids, one image pad each) of about `text_len` tokens besides the pad: the
    template's turns, one picture, an instruction of the corpus' words, different for every request."""

    def chat(text: str) -> list[int]:
        content = [{"type": "image"}, {"type": "text", "text": text}]
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": content}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )

    words = " ".join(corpus(2000, seed)).split()
    overhead = (
        len(chat(W6_INSTRUCTION)) - 1
    )  # the template's turns, the instruction and the picture's two marks
    per_word = len(tokenizer(" " + " ".join(words[:1000]))["input_ids"]) / 1000
    num_words = max(1, round((text_len - overhead) / per_word))
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        first = rng.randrange(len(words) - num_words)
        prompts.append(chat(W6_INSTRUCTION + " " + " ".join(words[first : first + num_words])))
    return prompts


def w6_requests(tokenizer, num: int, text_len: int, output_len: int, seed: int, image_size: tuple[int, int]):
    """The workload's `EngineRequest`s, request i with picture `seed + i`."""
    from worker.engine.api import EngineImage, EngineRequest, SamplingParams
    from worker.media.load import content_hash

    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=output_len, ignore_eos=True, repetition_penalty=1.0
    )
    requests = []
    for index, prompt_ids in enumerate(w6_prompts(tokenizer, num, text_len, seed)):
        picture = w6_picture(seed + index, image_size)
        requests.append(
            EngineRequest(
                str(index), prompt_ids, sampling, images=(EngineImage(content_hash(picture), picture),)
            )
        )
    return requests


def run_cbq(engine, requests) -> tuple[float, float, dict[str, Any]]:
    """Seconds to run `requests` through the started engine as a worker feeds it, the seconds spent in
    `add_request`, and the results by request id."""
    results: dict[str, Any] = {}
    adding = 0.0
    start = time.perf_counter()
    engine.start()
    try:
        for request in requests:
            t0 = time.perf_counter()
            engine.add_request(request)
            adding += time.perf_counter() - t0
            while not engine.has_capacity():
                _collect(engine, results, timeout=0.05)
        while len(results) < len(requests):
            _collect(engine, results, timeout=1.0)
    finally:
        engine.shutdown()
    return time.perf_counter() - start, adding, results


def _collect(engine, results: dict[str, Any], timeout: float) -> None:
    for result in engine.get_results(timeout=timeout):
        if result.error:
            raise click.ClickException(f"request {result.request_id} failed: {result.error}")
        results[result.request_id] = result


def run_hf(whole, folder: Path, requests, batch_size: int) -> tuple[float, list[list[int]]]:
    """Seconds for transformers' `generate` on `requests` (greedy, their max_new_tokens, no EOS) in left-padded
    batches of the image processor's inputs (the processing timed too), and each request's new tokens."""
    import numpy as np
    import torch
    from transformers import GenerationConfig

    from worker.media.qwen_vl import QwenVLImages

    processor = QwenVLImages(folder)
    device = next(whole.parameters()).device
    pad_id = whole.generation_config.pad_token_id
    new_tokens = requests[0].sampling.max_new_tokens

    def generate(batch, max_new: int) -> list[list[int]]:
        encoded = [processor.encode(r.images[0].image) for r in batch]
        ids = [processor.expand(r.prompt_ids, [e.grid]) for r, e in zip(batch, encoded, strict=True)]
        width = max(len(i) for i in ids)
        input_ids = torch.tensor([[pad_id] * (width - len(i)) + i for i in ids])
        inputs = dict(
            input_ids=input_ids,
            attention_mask=torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
            pixel_values=torch.from_numpy(np.concatenate([e.pixel_values for e in encoded])),
            image_grid_thw=torch.tensor([[e.grid.t, e.grid.h, e.grid.w] for e in encoded]),
            mm_token_type_ids=(input_ids == processor.image_token_id).int(),
        )
        gen = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=False,
            repetition_penalty=1.0,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
        out = whole.generate(**{k: v.to(device) for k, v in inputs.items()}, generation_config=gen)
        return out[:, width:].tolist()

    with eos_ignored(whole), torch.inference_mode():
        generate(requests[: min(2, len(requests))], 4)  # warm-up: kernels chosen, allocator grown
        _synchronize(device)
        start = time.perf_counter()
        tokens = [
            t
            for first in range(0, len(requests), batch_size)
            for t in generate(requests[first : first + batch_size], new_tokens)
        ]
        _synchronize(device)
    return time.perf_counter() - start, tokens


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


@click.command("vision")
@click.option("--workload", type=click.Choice(["W6"]), default="W6", show_default=True)
@click.option(
    "--shape",
    type=click.Choice(list(QWEN2_5_VL_SHAPES)),
    default="qwen2.5-vl-7b",
    show_default=True,
    help="Qwen2.5-VL-7B-Instruct's shape, or the tests' tiny one (random weights either way).",
)
@click.option(
    "--num", type=int, default=WORKLOAD_W6["num"], show_default=True, help="Requests in the workload."
)
@click.option(
    "--output-len",
    type=int,
    default=WORKLOAD_W6["output_len"],
    show_default=True,
    help="New tokens a request (EOS ignored).",
)
@click.option(
    "--text-len",
    type=int,
    default=WORKLOAD_W6["text_len"],
    show_default=True,
    help="Text tokens a prompt, about (the chat template's included, the image's not).",
)
@click.option(
    "--image-size",
    type=(int, int),
    default=W6_IMAGE_SIZE,
    show_default=True,
    help="Each picture's width and height.",
)
@click.option(
    "--hf-num-requests",
    type=int,
    default=16,
    show_default=True,
    help="Run transformers' generate on the first N requests (0 skips it).",
)
@click.option(
    "--hf-batch-size", type=int, default=None, help="Requests per generate call; default: all N at once."
)
@click.option("--mode", type=click.Choice(["async", "sync"]), default="async", show_default=True)
@compared_choice(
    "--decoder",
    "decoders",
    DECODERS,
    "The language model's decoder(s) (EngineConfig.decoder); repeat to compare in one process (each an engine "
    "of its own over the same model; the first is the one compared with transformers).",
)
@click.option(
    "--max-num-seqs", type=int, default=None, help="cbq's running requests at most (default: the engine's)."
)
@click.option(
    "--max-num-batched-tokens", type=int, default=None, help="cbq's tokens a step (default: the engine's)."
)
@click.option(
    "--warmup",
    type=int,
    default=8,
    show_default=True,
    help="Requests (their own pictures) cbq runs first, unmeasured.",
)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto: bf16 on CUDA, fp32 on the CPU.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default="vision_bench.json", show_default=True)
def vision_bench(
    workload,
    shape,
    num,
    output_len,
    text_len,
    image_size,
    hf_num_requests,
    hf_batch_size,
    mode,
    decoders,
    max_num_seqs,
    max_num_batched_tokens,
    warmup,
    device,
    dtype,
    seed,
    json_out,
):
    """W6 (a picture and ~100 text tokens in, 256 tokens out, a request) through cbq's engine vs transformers'
    generate, with the vision encoder's share of cbq's run."""
    import torch

    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.models import family_for
    from worker.engine.models.loader import resolve_device, resolve_dtype
    from worker.engine.models.vision import VisionLanguageModel
    from worker.engine.tokenizer import HFTokenizer

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        whole = random_qwen2_5_vl(shape, folder, torch_device, torch_dtype, seed)
        build_seconds = time.perf_counter() - t0
        tokenizer = HFTokenizer.from_pretrained(str(folder))
        image_size = tuple(image_size)
        requests = w6_requests(tokenizer.backend, num, text_len, output_len, seed, image_size)
        hf: dict[str, Any] | None = None
        hf_tokens: list[list[int]] = []
        if hf_num_requests > 0:  # first: the engine's KV cache then takes what the device has left
            hf_requests = requests[:hf_num_requests]
            seconds, hf_tokens = run_hf(whole, folder, hf_requests, hf_batch_size or len(hf_requests))
            hf = _rates(len(hf_requests), sum(map(len, hf_tokens)), seconds)
            hf["batch_size"] = hf_batch_size or len(hf_requests)
            if torch_device.type == "cuda":
                torch.cuda.empty_cache()
        settings = {
            k: v
            for k, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens))
            if v
        }
        family = family_for(whole.config)[0]
        assert family.vision is not None, f"{family.name} takes no images"
        by_decoder: dict[str, dict[str, Any]] = {}
        for decoder in decoders:
            config = EngineConfig(mode=mode, device=str(torch_device), dtype=dtype, decoder=decoder, **settings)
            engine = Engine(VisionLanguageModel(whole, family.vision), tokenizer, config)
            by_decoder[decoder], outcome = _run_cbq_measured(engine, requests, tokenizer, warmup, text_len, output_len,
                                                             image_size, mode)  # fmt: skip
            if decoder == decoders[0]:
                results = outcome
            engine.close()
            del engine
            if torch_device.type == "cuda":
                torch.cuda.empty_cache()
        cbq = by_decoder[decoders[0]]
    row: dict[str, Any] = {
        "workload": workload,
        "shape": shape,
        "num_requests": num,
        "output_len": output_len,
        "image_size": list(image_size),
        "mean_text_tokens": sum(len(r.prompt_ids) - 1 for r in requests) / num,
        "device": str(torch_device),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "build_seconds": build_seconds,
        "cbq": cbq,
        "hf": hf,
    }
    if len(decoders) > 1:
        row["cbq_by_decoder"] = by_decoder
    if hf is not None:
        row["ratio"] = cbq["requests_per_s"] / hf["requests_per_s"]
        # greedy on the same module: equal in fp32 (the CPU test checks it); in bf16 batching may flip near-ties
        row["hf_requests_equal"] = sum(
            results[r.request_id].token_ids == t
            for r, t in zip(requests[: len(hf_tokens)], hf_tokens, strict=True)
        )
    row["targets"] = {"ratio": TARGET_RATIO, "encoder_share_of_run": TARGET_ENCODER_SHARE}
    _print_table(row)
    report = {
        **run_header(),
        "rows": [row],
    }
    Path(json_out).write_text(json.dumps(report, indent=2))
    click.echo(f"wrote {json_out}")


def _run_cbq_measured(
    engine, requests, tokenizer, warmup: int, text_len: int, output_len: int, image_size, mode: str
) -> tuple[dict[str, Any], dict]:
    """One engine's measured W6 run after its warm-up: its rates and step profile, and its results by request id."""
    images = engine.runner.images
    assert images is not None, "the engine took the model for a text-only one"
    if warmup:
        run_cbq(engine, w6_requests(tokenizer.backend, warmup, text_len, output_len, WARMUP_SEED, image_size))
    engine.reset_stats()
    encoded_before, encoder_before = images.num_encoded, images.encode_seconds
    with triton_compiles() as compiled:
        wall, adding, results = run_cbq(engine, requests)
    if compiled:
        click.echo(
            f"warning: {len(compiled)} Triton compile(s) during the measured run "
            f"({', '.join(sorted(set(compiled)))}): its times include them",
            err=True,
        )
    stats = engine.stats()
    encoder = images.encode_seconds - encoder_before
    output_tokens = sum(len(r.token_ids) for r in results.values())
    # image tokens are prompt tokens, as OpenAI counts them
    prompt_tokens = sum(r.usage.prompt_tokens for r in results.values())
    num = len(requests)
    cbq = _rates(num, output_tokens, wall)
    cbq.update(
        decoder="owned" if engine.runner.decoder is not None else "hf",
        total_tok_s=(output_tokens + prompt_tokens) / wall,
        prompt_tokens=prompt_tokens,
        mean_image_tokens=(prompt_tokens - sum(len(r.prompt_ids) for r in requests)) / num + 1,
        steps=stats.steps,
        device_seconds=stats.busy_seconds,
        encoder_seconds=encoder,
        decoder_seconds=stats.busy_seconds - encoder,
        encoder_share_of_run=encoder / wall,
        encoder_share_of_device=encoder / stats.busy_seconds if stats.busy_seconds else 0.0,
        images_encoded=images.num_encoded - encoded_before,
        admission_seconds=adding,
        num_preemptions=stats.num_preemptions,
        triton_compiles=compiled,
        mode=mode,
        max_num_seqs=engine.config.max_num_seqs,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        num_kv_blocks=engine.runner.num_kv_blocks,
        graphs=len(engine.runner.graphs),
    )
    return cbq, results


def _rates(num_requests: int, output_tokens: int, seconds: float) -> dict[str, Any]:
    return {
        "num_requests": num_requests,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "requests_per_s": num_requests / seconds,
        "output_tok_s": output_tokens / seconds,
    }


def _print_table(row: dict[str, Any]) -> None:
    cbq, hf = row["cbq"], row["hf"]
    click.echo(
        f"\n{row['workload']} on {row['shape']} ({row['dtype']}, {row['device']}): {row['num_requests']} "
        f"requests, {cbq['mean_image_tokens']:.0f} image + {row['mean_text_tokens']:.0f} text tokens in, "
        f"{row['output_len']} out"
    )
    click.echo(f"{'':<6} {'requests':>8} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'seconds':>8}")
    for name, run in row.get("cbq_by_decoder", {"": cbq}).items():
        label = f"cbq {name}".strip()
        click.echo(
            f"{label:<6} {run['num_requests']:>8} {run['requests_per_s']:>8.2f} {run['output_tok_s']:>10.0f} "
            f"{run['total_tok_s']:>12.0f} {run['seconds']:>8.1f}"
        )
    if hf is not None:
        click.echo(
            f"{'hf':<6} {hf['num_requests']:>8} {hf['requests_per_s']:>8.2f} {hf['output_tok_s']:>10.0f} "
            f"{'-':>12} {hf['seconds']:>8.1f}"
        )
        click.echo(
            f"cbq / transformers requests/s: {row['ratio']:.2f} (target >= {TARGET_RATIO:g}); "
            f"same tokens on {row['hf_requests_equal']} of {hf['num_requests']}"
        )
    click.echo(
        f"step profile: encoder {cbq['encoder_seconds']:.2f} s ({cbq['encoder_share_of_run']:.1%} of the run, "
        f"target <= {TARGET_ENCODER_SHARE:.0%}; {cbq['encoder_share_of_device']:.1%} of the steps' device "
        f"time), decoder {cbq['decoder_seconds']:.2f} s, {cbq['steps']} steps, admission "
        f"{cbq['admission_seconds']:.2f} s"
    )
