"""The demo's chat workload: users asking real questions under one shared system prompt, and how their
streaming answers are shown (a live board for a terminal, plain lines for logs).

Used by ``kvserve demo`` (kvserve/cluster/demo.py) when it serves a real instruct model (SmolLM2-135M-Instruct,
fetched once by ``cluster.model_fetch``). Every request is ``GenerateRequest.messages``: the router
renders the model's chat template, so the shared system prompt becomes a shared token prefix, which
the workers' prefix caches serve from the second request on.
"""

from __future__ import annotations

import textwrap
import threading

MODEL_NAME = "smollm2-135m-instruct"  # a key of kvserve/cluster/models.json
ANSWER_TOKENS = 64  # a few lines each: long enough to read, short enough for a CPU demo

# NOTE: long on purpose: ~100 tokens (6 blocks of 16) that every request shares, so the summary's prefix
# hit rate means something; short sentences, because a 135M model follows simple instructions best.
SYSTEM_PROMPT = (
    "You are a friendly and knowledgeable assistant for curious people of all ages. "
    "Answer the user's question directly in two or three short sentences of plain English. "
    "Be accurate and specific. Give the key fact first, then one sentence that explains it. "
    "Do not use lists, headings or code. Do not repeat the question. "
    "If you are not sure about something, say so briefly instead of guessing."
)

QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do plants make their food?",
    "What is a prime number?",
    "Who wrote Romeo and Juliet?",
    "What causes the seasons on Earth?",
    "What does a computer's CPU do?",
    "How does a rainbow form?",
    "What is the largest planet in our solar system?",
    "Why do we need to sleep?",
    "What is the boiling point of water at sea level?",
    "How many legs does a spider have?",
)


def chat_messages(index: int) -> tuple[tuple[str, str], ...]:
    """The (role, content) messages of user ``index``: the shared system prompt and one question."""
    return (("system", SYSTEM_PROMPT), ("user", QUESTIONS[index % len(QUESTIONS)]))


class AnswerBoard:
    """Streaming answers by request index (thread-safe: the request threads append, the view reads)."""

    def __init__(self, questions: dict[int, str]) -> None:
        self._questions = dict(questions)
        self._answers: dict[int, str] = {i: "" for i in questions}
        self._done: set[int] = set()
        self._lock = threading.Lock()

    def append(self, index: int, text: str) -> None:
        with self._lock:
            self._answers[index] += text

    def finish(self, index: int) -> None:
        with self._lock:
            self._done.add(index)

    def answer(self, index: int) -> str:
        with self._lock:
            return self._answers[index]

    def render(self, width: int):  # noqa: ANN201 - a rich renderable
        """A table: one row per user (question, then the answer so far; a cursor while it streams)."""
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, show_header=True, expand=True, pad_edge=False, header_style="bold")
        table.add_column("#", justify="right", no_wrap=True)
        table.add_column("question", style="cyan", ratio=1, overflow="fold")
        table.add_column("answer (streaming)", ratio=3 if width >= 100 else 2, overflow="fold")
        with self._lock:
            for i, question in self._questions.items():
                answer = Text(" ".join(self._answers[i].split()))
                if i not in self._done:
                    answer.append(" ▌", style="bold green")
                table.add_row(str(i + 1), question, answer)
        return table


def format_exchange(question: str, answer: str, width: int = 100) -> str:
    """The plain-text form of one finished exchange (for logs and ``--no-live``)."""
    indent = "      "
    q = textwrap.fill(question, width, initial_indent="    Q: ", subsequent_indent=indent)
    a = textwrap.fill(" ".join(answer.split()) or "(empty)", width, initial_indent="    A: ", subsequent_indent=indent)
    return f"{q}\n{a}"
