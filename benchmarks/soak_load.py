"""The soak's traffic: streaming clients (the official openai client) sending requests whose
prompts share prefixes, as multi-turn chat does: greedy, seeded, greedy under a LoRA adapter
(every node serves it) and greedy under a regular expression (structured output), and comparing
every answer with the offline engine's (the cluster's decode-1 speculates, so requests move
between a node that drafts and one that does not); some clients leave at a chosen stage (queued, prefilling, in the
handover, decoding) and are not waited for. A Gate holds traffic back for idle faults; each
client's first request after a pause must succeed at its first attempt.

A request the client keeps is retried after a connection error or an error event (the router
was killed, say) until its deadline; it is lost if it never completes by then, and hung if an
attempt got neither an answer nor an error before the deadline.
"""
from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from pdserve import LLM, SamplingParams
from pdserve.lora.request import LoRARequest
from pdserve.models.model_path import resolve_model_path
from pdserve.protocol.sampling_params import StructuredSpec
from pdserve.testing.lora_adapters import make_adapter

MODEL = "builtin:tiny"
PREFIXES = [f"System {i}: you are a careful assistant; answer in full sentences. " * (1 + i) for i in range(4)]
QUESTIONS = [f"Turn {j}: what follows from step {j}? " * (1 + j % 2) for j in range(6)]
MAX_TOKENS = 32
SEEDED = {"temperature": 0.9, "top_p": 0.95}
STAGES = ("queued", "prefilling", "handover", "decoding")
ADAPTER = "soak-lora"  # the name every node and the router serve it under
REGEX = r"[a-z]+( [a-z]+)*"  # open-ended: a greedy request runs its MAX_TOKENS under it
MODES = ("greedy", "seeded", "adapter", "regex")


def make_soak_adapter(out: Path) -> Path:
    """The adapter the soak serves: random PEFT weights on the built-in model."""
    return make_adapter(resolve_model_path(MODEL), out, seed=5, r=8, alpha=16)


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    slowest: tuple[float, str, str] = (0.0, "-", "-")  # seconds, which request, when it ended
    slowest_recovery: float = 0.0  # seconds from a fault's next turn to every process healthy
    phases: dict[str, float] = field(default_factory=dict)  # start-up, traffic, settle: seconds each
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def took(self, seconds: float, what: str) -> None:
        """A request answered after `seconds`, retries included: the slowest is reported."""
        with self.lock:
            self.slowest = max(self.slowest, (round(seconds, 1), what, time.strftime("%H:%M:%S")))

    def recovery(self, seconds: float) -> None:
        with self.lock:
            self.slowest_recovery = max(self.slowest_recovery, round(seconds, 1))

    def violate(self, kind: str, detail: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if len(self.violations) < 50:
                self.violations.append(f"{kind}: {detail}")


class Gate:
    """Traffic on, or held back (idle faults). Clients pass it before each request and count as
    busy while one runs, so that a pause is timed from the last request's end, not from when the
    gate closed; a client's first request after a pause is marked, so that the fault can wait for
    those requests and the client can hold them to their first attempt."""

    def __init__(self, clients: int):
        self.clients, self.busy, self.pauses, self.after_pause_left = clients, 0, 0, 0
        self._open = True
        self._cond = threading.Condition()

    def enter(self, timeout_s: float) -> int | None:
        """The count of pauses so far, once the gate is open (None if still closed at timeout_s)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._open, timeout_s):
                return None
            self.busy += 1
            return self.pauses

    def leave(self, after_pause: bool) -> None:
        with self._cond:
            self.busy -= 1
            self.after_pause_left -= after_pause
            self._cond.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Hold new requests back; True once none is running (within timeout_s)."""
        with self._cond:
            self._open = False
            return self._cond.wait_for(lambda: self.busy == 0, timeout_s)

    def reopen(self) -> None:
        with self._cond:
            if not self._open:
                self._open, self.pauses, self.after_pause_left = True, self.pauses + 1, self.clients
                self._cond.notify_all()

    def wait_after_pause(self, timeout_s: float) -> bool:
        """True once every client's first request after the last pause has ended."""
        with self._cond:
            return self._cond.wait_for(lambda: self.after_pause_left <= 0, timeout_s)


class Workload:
    """The prompts and what the offline engine (no speculation) answers to each in every mode."""

    def __init__(self, adapter: Path) -> None:
        self.prompts = [p + q for p in PREFIXES for q in QUESTIONS]
        llm = LLM(MODEL, num_kv_blocks=512, enable_lora=True)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        seeded = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=1000 + i, **SEEDED)
                  for i in range(len(self.prompts))]
        regex = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                               structured=StructuredSpec("regex", REGEX))
        runs = {"greedy": (greedy, None), "seeded": (seeded, None), "regex": (regex, None),
                "adapter": (greedy, LoRARequest(ADAPTER, 1, str(adapter)))}
        self.want: dict[tuple[int, str], str] = {}
        for mode, (params, lora) in runs.items():
            for i, out in enumerate(llm.generate(self.prompts, params, use_tqdm=False, lora_request=lora)):
                self.want[i, mode] = out.outputs[0].text

    def body(self, i: int, mode: str) -> dict:
        sampling = {"seed": 1000 + i, **SEEDED} if mode == "seeded" else {"temperature": 0}
        extra = {"ignore_eos": True, **({"guided_regex": REGEX} if mode == "regex" else {})}
        return {"model": ADAPTER if mode == "adapter" else MODEL, "prompt": self.prompts[i],
                "max_tokens": MAX_TOKENS, "extra_body": extra, **sampling}


class Client:
    """One client thread's loop; `gate` holds traffic back (idle faults), and `on_first_token`
    lets the fault injector act at the handover."""

    def __init__(self, url: str, work: Workload, tally: Tally, rng: random.Random, deadline_s: float,
                 abandon_rate: float, gate: Gate, on_first_token=None):
        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        self.work, self.tally, self.rng = work, tally, rng
        self.deadline_s, self.abandon_rate, self.gate = deadline_s, abandon_rate, gate
        self.on_first_token = on_first_token or (lambda: None)
        self.pauses_seen = 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            pauses = self.gate.enter(timeout_s=0.5)
            if pauses is None:
                continue
            after_pause, self.pauses_seen = pauses != self.pauses_seen, pauses
            i, mode = self.rng.randrange(len(self.work.prompts)), self.rng.choice(MODES)
            stage = self.rng.choice(STAGES) if self.rng.random() < self.abandon_rate else None
            try:
                self.request(i, mode, stage, after_pause)
            finally:
                self.gate.leave(after_pause)

    def request(self, i: int, mode: str, leave_at: str | None, after_pause: bool = False) -> None:
        deadline = time.monotonic() + self.deadline_s
        self.tally.add("requests")
        self.tally.add("requests after an idle pause", after_pause)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.tally.violate("lost", f"prompt {i} {mode}: no answer by its deadline")
                return
            try:
                text = self._attempt(i, mode, leave_at, left)
            except openai.APITimeoutError:
                sent = time.strftime("%H:%M:%S", time.localtime(time.time() - (time.monotonic() - deadline + self.deadline_s)))
                self.tally.violate("hung", f"prompt {i} {mode}: nothing for {self.deadline_s:.0f} s (sent {sent})")
                return
            except (openai.APIError, httpx.HTTPError, OSError) as exc:
                if after_pause:  # nothing was killed or stopped: the pause alone failed it
                    self.tally.violate("failed after idle", f"prompt {i} {mode}: {type(exc).__name__}: {exc}")
                self.tally.add("retries")
                self.tally.add(f"retry: {type(exc).__name__}")
                time.sleep(0.5)
                continue
            self.tally.took(time.monotonic() - (deadline - self.deadline_s), f"prompt {i} {mode}")
            if leave_at is not None:
                self.tally.add(f"fault: client left {leave_at}")
            elif text != self.work.want[i, mode]:
                self.tally.violate("text differs", f"prompt {i} {mode}: {text!r} != {self.work.want[i, mode]!r}")
            else:
                self.tally.add(f"completed {mode}")
            return

    def _attempt(self, i: int, mode: str, leave_at: str | None, timeout_s: float) -> str:
        stream = self.openai.completions.create(stream=True, timeout=timeout_s, **self.work.body(i, mode))
        leave = Leave(stream)
        if leave_at in ("queued", "prefilling"):  # gone before its first token, the second a moment later
            leave.after(0.0 if leave_at == "queued" else self.rng.uniform(0.02, 0.3))
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
        except Exception:  # the connection ended under the reader: whatever the read in flight raises
            if not leave.left:
                raise
        finally:
            leave.cancel()
            stream.close()
        return text


class Leave:
    """A client that leaves while its reader thread waits for bytes: a timer shuts the socket down
    (the router sees it go, the reader wakes), and does not close it: a close from another thread
    frees the descriptor while the reader still waits on it, so that the next connection opened
    could get that number and the reader read another connection's bytes, or wait on a silent
    one. Once the attempt ends, the timer does nothing (the connection may serve the next one)."""

    def __init__(self, stream):
        self.stream, self.left, self._done = stream, False, False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def after(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._leave)
        self._timer.start()

    def _leave(self) -> None:
        with self._lock:
            if self._done:
                return
            self.left = True
            sock = self.stream.response.extensions["network_stream"].get_extra_info("socket")
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # the router had already closed it
                pass

    def cancel(self) -> None:
        with self._lock:
            self._done = True
        if self._timer is not None:
            self._timer.cancel()
