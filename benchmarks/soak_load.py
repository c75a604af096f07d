"""The soak's traffic: streaming clients (the official openai client) sending greedy and seeded
requests whose prompts share prefixes, as multi-turn chat does, and comparing every answer with
the offline engine's; some clients leave at a chosen stage (queued, prefilling, in the
handover, decoding) and are not waited for.

A request the client keeps is retried after a connection error or an error event (the router
was killed, say) until its deadline; it is lost if it never completes by then, and hung if an
attempt got neither an answer nor an error before the deadline.
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import openai

from pdserve import LLM, SamplingParams

MODEL = "builtin:tiny"
PREFIXES = [f"System {i}: you are a careful assistant; answer in full sentences. " * (1 + i) for i in range(4)]
QUESTIONS = [f"Turn {j}: what follows from step {j}? " * (1 + j % 2) for j in range(6)]
MAX_TOKENS = 32
SEEDED = {"temperature": 0.9, "top_p": 0.95}
STAGES = ("queued", "prefilling", "handover", "decoding")


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def violate(self, kind: str, detail: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if len(self.violations) < 50:
                self.violations.append(f"{kind}: {detail}")


class Workload:
    """The prompts and what the offline engine answers to each, greedy and seeded."""

    def __init__(self) -> None:
        self.prompts = [p + q for p in PREFIXES for q in QUESTIONS]
        llm = LLM(MODEL, num_kv_blocks=512)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        self.want: dict[tuple[int, str], str] = {}
        for i, out in enumerate(llm.generate(self.prompts, greedy, use_tqdm=False)):
            self.want[i, "greedy"] = out.outputs[0].text
        seeded = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=1000 + i, **SEEDED)
                  for i in range(len(self.prompts))]
        for i, out in enumerate(llm.generate(self.prompts, seeded, use_tqdm=False)):
            self.want[i, "seeded"] = out.outputs[0].text

    def body(self, i: int, mode: str) -> dict:
        sampling = {"temperature": 0} if mode == "greedy" else {"seed": 1000 + i, **SEEDED}
        return {"prompt": self.prompts[i], "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}, **sampling}


class Client:
    """One client thread's loop; `gate` is cleared while the soak holds traffic (idle faults),
    and `on_first_token` lets the fault injector act at the handover."""

    def __init__(self, url: str, work: Workload, tally: Tally, rng: random.Random, deadline_s: float,
                 abandon_rate: float, gate: threading.Event, on_first_token=None):
        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        self.work, self.tally, self.rng = work, tally, rng
        self.deadline_s, self.abandon_rate, self.gate = deadline_s, abandon_rate, gate
        self.on_first_token = on_first_token or (lambda: None)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.gate.wait(timeout=0.5):
                continue
            i, mode = self.rng.randrange(len(self.work.prompts)), self.rng.choice(("greedy", "seeded"))
            stage = self.rng.choice(STAGES) if self.rng.random() < self.abandon_rate else None
            self.request(i, mode, stage)

    def request(self, i: int, mode: str, leave_at: str | None) -> None:
        deadline = time.monotonic() + self.deadline_s
        self.tally.add("requests")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.tally.violate("lost", f"prompt {i} {mode}: no answer by its deadline")
                return
            try:
                text = self._attempt(i, mode, leave_at, left)
            except openai.APITimeoutError:
                self.tally.violate("hung", f"prompt {i} {mode}: nothing for {self.deadline_s:.0f} s")
                return
            except (openai.APIError, httpx.HTTPError, OSError) as exc:
                self.tally.add("retries")
                self.tally.add(f"retry: {type(exc).__name__}")
                time.sleep(0.5)
                continue
            if leave_at is not None:
                self.tally.add(f"fault: client left {leave_at}")
            elif text != self.work.want[i, mode]:
                self.tally.violate("text differs", f"prompt {i} {mode}: {text!r} != {self.work.want[i, mode]!r}")
            else:
                self.tally.add(f"completed {mode}")
            return

    def _attempt(self, i: int, mode: str, leave_at: str | None, timeout_s: float) -> str:
        stream = self.openai.completions.create(model=MODEL, stream=True, timeout=timeout_s, **self.work.body(i, mode))
        if leave_at in ("queued", "prefilling"):  # gone before its first token, the second a moment later
            timer = threading.Timer(0.0 if leave_at == "queued" else self.rng.uniform(0.02, 0.3), stream.close)
            timer.start()
        text, chunks = "", 0
        try:
            for chunk in stream:
                if not chunk.choices:
                    continue
                text += chunk.choices[0].text
                chunks += 1
                if chunks == 1:
                    self.on_first_token()
                if (leave_at == "handover" and chunks == 1) or (leave_at == "decoding" and chunks == 6):
                    break
        except Exception:  # closed under the reader: whatever the read in flight raises
            if leave_at not in ("queued", "prefilling"):
                raise
        finally:
            stream.close()
        return text
