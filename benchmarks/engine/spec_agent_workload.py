"""A multi-turn, agent-style workload for bench_spec_decode (--workload agent): each conversation
is a coding agent that calls tools by writing JSON lines. Turn by turn the model's own answer and
a canned tool result join the conversation, so later prompts hold earlier answers (what the
request's own suffix tree matches), and the conversations repeat one another's tool-call shapes
over different files (what suffix decoding's global tree, over earlier requests' outputs,
matches). Each conversation has its own repository listing; the turns are the same asks."""
from __future__ import annotations

import statistics

SYSTEM = ("You are a coding agent working in a Python repository. You act only by calling tools, one JSON "
          "object per line, exactly in this form:\n"
          '{"tool": "read_file", "path": "<path>"}\n'
          '{"tool": "run_tests", "path": "<test path>"}\n'
          '{"tool": "write_file", "path": "<path>", "summary": "<one line>"}\n'
          "Write nothing but tool calls.")
REPOS = [
    ["src/app/config.py", "src/app/models.py", "src/app/views.py", "src/app/forms.py", "src/app/urls.py",
     "src/app/admin.py", "src/app/utils.py", "src/app/tasks.py"],
    ["lib/parser/lexer.py", "lib/parser/tokens.py", "lib/parser/grammar.py", "lib/parser/ast.py",
     "lib/parser/errors.py", "lib/parser/visitor.py", "lib/parser/printer.py", "lib/parser/cli.py"],
    ["pkg/store/cache.py", "pkg/store/disk.py", "pkg/store/memory.py", "pkg/store/redis.py",
     "pkg/store/keys.py", "pkg/store/stats.py", "pkg/store/evict.py", "pkg/store/config.py"],
    ["service/api/routes.py", "service/api/auth.py", "service/api/schemas.py", "service/api/db.py",
     "service/api/errors.py", "service/api/jobs.py", "service/api/logs.py", "service/api/main.py"],
]
ASKS = [
    "Read every file of the repository, one read_file call per file, in the order listed.",
    "Run the tests of every file you read: one run_tests call per file, its test at tests/test_<name>.py.",
    "Two tests failed, for the first and the last file. Read both files again, then write a fixed version of each.",
]


def _tool_result(turn: int, files: list[str]) -> str:
    if turn == 0:
        return "\n".join(f"{f}: {40 + 7 * i} lines, defines {f.rsplit('/', 1)[-1][:-3]}_main()" for i, f in enumerate(files))
    if turn == 1:
        return "\n".join(f"tests/test_{f.rsplit('/', 1)[-1]}: {'FAILED' if i in (0, len(files) - 1) else 'passed'}"
                         for i, f in enumerate(files))
    return "ok"


class AgentConversations:
    """concurrency conversations; prompts(turn) gives each one's token ids, answer() appends."""

    def __init__(self, tokenizer, concurrency: int):
        self.tokenizer = tokenizer
        self.files = [REPOS[i % len(REPOS)] for i in range(concurrency)]
        self.messages = [[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "The repository's files:\n" + "\n".join(files)}]
                         for files in self.files]

    def prompts(self, turn: int) -> list[list[int]]:
        out = []
        for messages in self.messages:
            chat = messages + [{"role": "user", "content": ASKS[turn]}] if turn == 0 else messages
            text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            out.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return out

    def answer(self, turn: int, answers: list[list[int]]) -> None:
        for messages, files, ids in zip(self.messages, self.files, answers):
            if turn == 0:
                messages.append({"role": "user", "content": ASKS[0]})
            messages.append({"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)})
            result = _tool_result(turn, files)
            ask = ASKS[turn + 1] if turn + 1 < len(ASKS) else "Done."
            messages.append({"role": "user", "content": f"Tool results:\n{result}\n\n{ask}"})


def run_agent(llm, tokenizer, concurrency: int, new_tokens: int, run) -> dict:
    """All turns of concurrency conversations (each turn's requests decoded together): tokens/s
    over the turns, the median turn's TPOT p50; run(llm, prompts, new_tokens) -> dict with
    tokens, wall, cpu, drafted, accepted, tpot_ms and ids (each request's output)."""
    convs = AgentConversations(tokenizer, concurrency)
    tokens = wall = cpu = drafted = accepted = 0.0
    outputs, tpots = [], []
    for turn in range(len(ASKS)):
        r = run(llm, convs.prompts(turn), new_tokens)
        tokens, wall, cpu = tokens + r["tokens"], wall + r["wall"], cpu + r["cpu"]
        drafted, accepted = drafted + r["drafted"], accepted + r["accepted"]
        outputs.append(r["ids"])
        tpots.append(r["tpot_ms"])
        convs.answer(turn, r["ids"])
    return {"tok_s": tokens / wall, "cpu_tok_s": tokens / cpu, "tpot_ms": statistics.median(tpots),
            "acceptance": accepted / drafted if drafted else None, "compiled": "-", "ids": outputs}
