"""What the encoder cache saves on the workload "repeated images": one picture that several
requests ask about with different text before it, so the prefix cache stops before the image
and only the encoder cache can spare encoding it again; then follow-up turns that resend the
first conversation with the picture in it (follow-up 1 recomputes the first prompt's last,
uncached block, which holds image tokens; a later one finds the whole image in the prefix cache
that follow-up 1 filled, and encodes nothing either way). The same engine with the cache on (the default) and off
(encoder_cache_tokens=0), in one run on the same machine, on a tiny random Qwen2.5-VL whose
vision tower is made big enough (--depth, --hidden) that encoding a --size x --size image costs
something measurable on CPU. TTFT per request: generate with max_tokens=1, one request at a
time, timed with time.perf_counter. Each rep asks about a new picture (its first request encodes
it in both engines); reps alternate between the engines so a change in the machine's load hits
each alike; medians over --reps. Run:

    .venv/bin/python -m benchmarks.engine.bench_encoder_cache --reps 5
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

QUESTIONS = [
    "What is in this picture? ", "Describe the colours you see here: ", "Is there a person in this image? ",
    "Count the objects shown: ", "Write a short caption for this photo: ", "Which season could this be? ",
    "What would you title this painting? ", "Is this picture taken indoors or outdoors? ",
    "List three details of the scene: ", "What mood does this image give? ", "Where might this have been taken? ",
    "What is the main subject here? ",
]
ANSWER = "It shows a field of coloured noise, bright and without any clear shape or object in it."
FOLLOW_UPS = ["And what about the top left corner?", "Could you say that in fewer words?",
              "Which colour is the most common?", "Is there any text in it?"]


def chat(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def workload(tokenizer, asks: int, follow_ups: int) -> list[tuple[str, str]]:
    """(kind, prompt) for one picture: `asks` questions with different text before the image,
    then `follow_ups` second turns of the first conversation (history resent, a new question)."""
    first = [{"type": "text", "text": QUESTIONS[0]}, {"type": "image"}]
    out = [("first ask", chat(tokenizer, [{"role": "user", "content": first}]))]
    for q in QUESTIONS[1:asks]:
        out.append(("repeated asks", chat(tokenizer, [{"role": "user", "content": [{"type": "text", "text": q},
                                                                                    {"type": "image"}]}])))
    for i, q in enumerate(FOLLOW_UPS[:follow_ups]):
        out.append((f"follow-up {i + 1}", chat(tokenizer, [{"role": "user", "content": first},
                                                   {"role": "assistant", "content": ANSWER},
                                                   {"role": "user", "content": q}])))
    return out


def run_rep(llm, requests, picture, params) -> dict[str, list[float]]:
    """Seconds to the first token of each request, one at a time, by kind; 'total' the whole."""
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for kind, prompt in requests:
        t0 = time.perf_counter()
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [picture]}}, params, use_tqdm=False)
        times.setdefault(kind, []).append(time.perf_counter() - t0)
    times["total"] = [time.perf_counter() - start]
    return times


def main() -> None:
    from PIL import Image

    from pdserve import LLM, SamplingParams
    from pdserve.testing.vlm_checkpoints import make_qwen2_5_vl
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--asks", type=int, default=8, help="requests about one picture, different text before it")
    parser.add_argument("--follow-ups", type=int, default=2, help="second turns resending the first conversation")
    parser.add_argument("--size", type=int, default=224, help="image side in pixels (max_pixels is 224*224)")
    parser.add_argument("--depth", type=int, default=8, help="vision tower blocks")
    parser.add_argument("--hidden", type=int, default=256, help="vision tower width")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for both engines")
    args = parser.parse_args()
    vision = dict(depth=args.depth, hidden_size=args.hidden, num_heads=4, intermediate_size=2 * args.hidden,
                  out_hidden_size=64, fullatt_block_indexes=list(range(3, args.depth, 4)))
    path = make_qwen2_5_vl(Path(tempfile.mkdtemp(prefix="bench-encoder-cache-")), vision_overrides=vision)
    engines = {"cache on": LLM(str(path)), "cache off": LLM(str(path), encoder_cache_tokens=0)}
    torch.set_num_threads(args.threads)  # after the engines: building the first one resets torch's threads
    tokenizer = engines["cache on"].get_tokenizer()
    requests = workload(tokenizer, args.asks, args.follow_ups)
    params = SamplingParams(max_tokens=1, temperature=0)
    rng = np.random.RandomState(0)

    def picture():
        return Image.fromarray(rng.randint(0, 256, (args.size, args.size, 3), dtype=np.uint8))

    warm = picture()
    for llm in engines.values():  # warm-up: the first generate pays one-time costs
        run_rep(llm, requests[:2], warm, params)
    base = {name: (llm.engine.encoder_stats.encoder_runs, llm.engine.encoder_stats.hits)
            for name, llm in engines.items()}
    results: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for rep in range(args.reps):  # a new picture each rep; the engines alternate, and which goes first
        pic = picture()
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            for kind, values in run_rep(engines[name], requests, pic, params).items():
                results[name].setdefault(kind, []).extend(values)
    assert torch.get_num_threads() == args.threads, "torch threads changed during the run"
    on, off = results["cache on"], results["cache off"]
    counts = {kind: sum(k == kind for k, _ in requests) for kind in on if kind != "total"}
    image_tokens = engines["cache on"].engine.encoder_stats.encoded_tokens // (args.reps + 1)
    print(f"Qwen2.5-VL (random), vision tower depth {args.depth}, hidden {args.hidden}; {args.size}x{args.size} "
          f"images ({image_tokens} image tokens); {len(requests)} requests a picture, max_tokens=1, one at a time; "
          f"torch threads {torch.get_num_threads()}, {args.reps} reps (a new picture each)")
    print("| requests | per picture | TTFT cache on (ms, median) | TTFT cache off (ms, median) | off / on |")
    print("|---|---:|---:|---:|---:|")
    for kind, n in counts.items():
        a, b = statistics.median(on[kind]) * 1e3, statistics.median(off[kind]) * 1e3
        print(f"| {kind} | {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    every = [v for k in counts for v in on[k]], [v for k in counts for v in off[k]]
    a, b = (statistics.median(v) * 1e3 for v in every)
    print(f"| all requests | {len(requests)} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    a, b = statistics.median(on["total"]) * 1e3, statistics.median(off["total"]) * 1e3
    print(f"| whole workload, total (ms, median over reps) | {len(requests)} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    print()
    print("| engine | encoder runs (timed reps) | per picture | cache hits (timed reps) |")
    print("|---|---:|---:|---:|")
    for name, llm in engines.items():
        runs, hits = (x - y for x, y in zip((llm.engine.encoder_stats.encoder_runs, llm.engine.encoder_stats.hits),
                                            base[name]))
        print(f"| {name} | {runs} | {runs / args.reps:.1f} | {hits} |")


if __name__ == "__main__":
    main()
