"""``kvserve bench offline --peer``: the peer runner's plumbing, against fake peer scripts.

The fakes are tiny Python files speaking ``kvserve/cluster/bench/peers_protocol.py`` (no vLLM here): they check
what the runner hands them (command line, the workload's exact prompts) and answer with chosen timings
and tokens, so the side-by-side figures (ratios, token agreement) can be checked exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvserve.cluster.bench import peers
from kvserve.cluster.bench.peers import PeerRun, compare, format_table, peer_command, resolve_peer
from kvserve.cluster.bench.workloads import prompts
from kvserve.cluster.cli import main
from kvserve.workers.models.random_model import init_random

# A raw fake: emits the protocol lines by hand. Env: FAKE_SECONDS (seconds it reports per pass),
# FAKE_TOKENS (a --dump-tokens file: it answers those tokens, with request 0's first token changed),
# FAKE_LOG (it appends its argv, its prompts file and one line per run there), FAKE_MODE (misbehaviours).
RAW_FAKE = textwrap.dedent(
    """
    import json, os, sys
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    spec = json.load(open(args["--prompts"]))
    log = open(os.environ["FAKE_LOG"], "a")
    log.write(json.dumps({"argv": sys.argv[1:], "spec": spec}) + "\\n"); log.flush()
    mode = os.environ.get("FAKE_MODE", "")
    if mode == "die":
        print("fake peer: cannot load the model", file=sys.stderr)
        sys.exit(3)
    print("INFO some engine chatter KVSERVE_PEER not at the start", flush=True)
    print('KVSERVE_PEER READY {"engine": "fake", "version": "0"}', flush=True)
    tokens = json.load(open(os.environ["FAKE_TOKENS"]))["token_ids"] if "FAKE_TOKENS" in os.environ else [
        [1] * spec["max_tokens"] for _ in spec["prompt_token_ids"]]
    tokens[0][0] += 1
    if mode == "short":
        tokens = tokens[:-1]
    for line in sys.stdin:
        assert line.strip() == "run", line
        log.write("run\\n"); log.flush()
        print(f"KVSERVE_PEER RESULT {json.dumps({'seconds': float(os.environ['FAKE_SECONDS']), 'token_ids': tokens})}",
              flush=True)
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    init_random(d, arch="llama", size="tiny", seed=0)
    return d


@pytest.fixture()
def raw_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake_peer.py"
    script.write_text(RAW_FAKE)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake.log"))
    monkeypatch.setenv("FAKE_SECONDS", "2.0")
    return script


def _bench(model_dir: Path, *extra: str, n: int = 3, tokens: int = 4) -> list[str]:
    return ["bench", "offline", "--model", str(model_dir), "--workload", "tiny", "--num-requests", str(n),
            "--max-tokens", str(tokens), "--kv-cache-memory", "64MiB", *extra]  # fmt: skip


def test_workload_definition_is_pinned() -> None:
    """The prompts the published figures were measured on (and that peers receive) must not drift."""
    tiny, out = prompts("tiny")
    assert (len(tiny), out, len(prompts("small")[0]), prompts("small")[1]) == (64, 64, 32, 128)
    digest = hashlib.sha256(json.dumps([tiny, prompts("small")[0]]).encode()).hexdigest()[:16]
    assert digest == WORKLOAD_DIGEST


WORKLOAD_DIGEST = "7861c7ed72e42df6"


def test_peer_command_and_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "p.py"
    script.write_text("")
    assert peer_command("/x/python", script, "/m", tmp_path / "q.json") == [
        "/x/python", str(script), "--model", "/m", "--prompts", str(tmp_path / "q.json")]  # fmt: skip
    monkeypatch.delenv(peers.PEER_PYTHON_ENV, raising=False)
    assert resolve_peer("vllm", sys.executable, None) == (sys.executable, peers.PEER_SCRIPTS["vllm"])
    assert resolve_peer("hf", sys.executable, None)[1].name == "peers_hf.py"
    assert resolve_peer("mine", sys.executable, str(script)) == (sys.executable, script)
    with pytest.raises(ValueError, match="--peer-python"):
        resolve_peer("vllm", None, None)
    monkeypatch.setenv(peers.PEER_PYTHON_ENV, sys.executable)
    assert resolve_peer("vllm", None, None)[0] == sys.executable
    with pytest.raises(ValueError, match="unknown peer 'sglang'"):
        resolve_peer("sglang", None, None)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_peer("vllm", str(tmp_path / "no-python"), None)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_peer("x", None, str(tmp_path / "no-script.py"))


def test_compare_ratios_and_table() -> None:
    ours = [300.0, 100.0, 200.0]
    theirs = [PeerRun(1.0, [[1, 2], [3, 4]]), PeerRun(2.0, [[1, 2], [3, 4]]), PeerRun(4.0, [[1, 2], [3, 9]])]
    c = compare("vllm", ours, theirs, [[1, 2], [3, 4]])
    assert c.peer_tokens_per_s == [4.0, 2.0, 1.0]
    assert (c.ours_median, c.peer_median, c.ratio) == (200.0, 2.0, 100.0)
    assert c.round_ratios == [75.0, 50.0, 200.0]
    assert (c.identical_requests, c.num_requests, c.token_agreement) == (1, 2, 0.75)  # the last round's tokens
    table = format_table(c, "tiny")
    row = "| tiny | 200.0 (300.0, 100.0, 200.0) | 2.0 (4.0, 2.0, 1.0) | 100.00x | 75.00, 50.00, 200.00 | 1/2 |"
    assert row in table
    assert "kvserve / vllm" in table
    with pytest.raises(ValueError, match="same non-zero number of rounds"):
        compare("vllm", [1.0], [], [[1]])
    with pytest.raises(ValueError):
        compare("vllm", [1.0], [PeerRun(1.0, [[1]])], [[1], [2]])


def test_bench_alternates_with_a_fake_peer(
    model_dir: Path, raw_fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = tmp_path / "ours.json"
    assert main(_bench(model_dir, "--json", "--runs", "1", "--dump-tokens", str(ours))) == 0
    capsys.readouterr()
    monkeypatch.setenv("FAKE_TOKENS", str(ours))
    argv = _bench(model_dir, "--json", "--runs", "2", "--peer", "fake", "--peer-python", sys.executable,
                  "--peer-script", str(raw_fake))  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    peer = result["peer"]
    assert peer["peer"] == "fake" and peer["peer_per_round"] == [6.0, 6.0]  # 3 requests x 4 tokens / 2.0 s
    assert peer["ours_per_round"] == [pytest.approx(x, abs=0.06) for x in result["per_run_output_tokens_per_s"]]
    assert peer["ratio"] == pytest.approx(result["output_tokens_per_s"] / 6.0)
    assert peer["round_ratios"] == [pytest.approx(x / 6.0) for x in peer["ours_per_round"]]
    # The fake answered our own tokens except request 0's first one.
    assert (peer["identical_requests"], peer["num_requests"]) == (2, 3)
    assert peer["token_agreement"] == pytest.approx(11 / 12)

    log = (tmp_path / "fake.log").read_text().splitlines()
    start = json.loads(log[0])
    assert start["argv"][0::2] == ["--model", "--prompts"] and start["argv"][1] == str(model_dir)
    # the peer runs at most as many requests at once as ours (the engine's default: 256)
    assert start["spec"] == {
        "prompt_token_ids": prompts("tiny")[0][:3], "max_tokens": 4, "engine": {"max_num_seqs": 256}}  # fmt: skip
    assert log[1:] == ["run", "run"]  # one peer pass per round, after the peer loaded


def test_text_output_prints_the_side_by_side_table(
    model_dir: Path, raw_fake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _bench(model_dir, "--runs", "1", "--peer", "fake", "--peer-python", sys.executable,
                  "--peer-script", str(raw_fake))  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| workload | kvserve tok/s | fake tok/s | kvserve / fake |" in out
    assert "| tiny |" in out and "| 6.0 (6.0) |" in out


def test_served_batch_size_reaches_the_peer_and_labels_the_row(
    model_dir: Path, raw_fake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-num-seqs 2`` (a served batch size): both engines run at most 2 requests at once."""
    argv = _bench(model_dir, "--runs", "1", "--max-num-seqs", "2", "--peer", "fake", "--peer-python", sys.executable,
                  "--peer-script", str(raw_fake))  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| tiny, max_num_seqs=2 |" in out
    assert re.search(r"peak running requests\s*│\s*2\s*│", out), out  # ours ran 2 at once, not 3
    spec = json.loads((tmp_path / "fake.log").read_text().splitlines()[0])["spec"]
    assert spec["engine"] == {"max_num_seqs": 2}


def test_peer_scripts_refuse_settings_they_cannot_apply(tmp_path: Path) -> None:
    """The HF peer cannot cap its running requests: a cap that binds is an error, not a silent full batch."""
    for name in ("peers_hf.py", "peers_vllm.py", "peers_protocol.py"):
        shutil.copy(Path(peers.__file__).with_name(name), tmp_path / name)
    with pytest.raises(peers.PeerError, match="hf peer: cannot apply engine settings"):
        with peers.PeerProcess(sys.executable, tmp_path / "peers_hf.py", "m", [[5], [6], [7]], 3, {"max_num_seqs": 2}):
            pass
    with pytest.raises(peers.PeerError, match=r"vllm peer: cannot apply engine settings \['block_size'\]"):
        with peers.PeerProcess(sys.executable, tmp_path / "peers_vllm.py", "m", [[5]], 3, {"block_size": 4}):
            pass


@pytest.mark.parametrize(("mode", "message"), [("die", "cannot load the model"), ("short", "expected token ids for 3")])
def test_a_failing_peer_is_a_clear_error(
    model_dir: Path, raw_fake: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], mode: str,
    message: str,
) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_MODE", mode)
    argv = _bench(model_dir, "--json", "--runs", "1", "--peer", "fake", "--peer-python", sys.executable,
                  "--peer-script", str(raw_fake))  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: peer ") and message in err


def test_missing_peer_python_is_a_usage_error(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(peers.PEER_PYTHON_ENV, raising=False)
    assert main(_bench(model_dir, "--peer", "vllm")) == 2
    assert "--peer-python" in capsys.readouterr().err


def test_protocol_module_serves_the_runner(tmp_path: Path) -> None:
    """A peer built on ``peers_protocol.serve`` (as the vLLM and HF scripts are) works with the runner."""
    shutil.copy(Path(peers.__file__).with_name("peers_protocol.py"), tmp_path / "peers_protocol.py")
    script = tmp_path / "echo_peer.py"
    script.write_text(textwrap.dedent(
        """
        from peers_protocol import parse_args, serve
        model, prompt_ids, max_tokens = parse_args()
        serve("echo", "1.0", lambda: [p[:1] * max_tokens for p in prompt_ids])
        """
    ))  # fmt: skip
    with peers.PeerProcess(sys.executable, script, "m", [[5, 6], [7]], 3) as proc:
        assert proc.info == {"engine": "echo", "version": "1.0"}
        first, second = proc.run(), proc.run()
    assert first.token_ids == second.token_ids == [[5, 5, 5], [7, 7, 7]]
    assert first.seconds > 0 and first.output_tokens_per_s == 6 / first.seconds


def test_cpu_seconds_per_round_in_the_comparison() -> None:
    theirs = [PeerRun(1.0, [[1, 2], [3, 4]], cpu_seconds=2.0), PeerRun(1.0, [[1, 2], [3, 4]], cpu_seconds=None)]
    c = compare("vllm", [4.0, 4.0], theirs, [[1, 2], [3, 4]], ours_per_cpu_s=[8.0, 6.0])
    assert c.peer_tokens_per_cpu_s == (2.0, None)
    assert c.as_dict()["ours_tokens_per_cpu_s"] == [8.0, 6.0]
    assert "kvserve 7.0, vllm 2.0 (3.50x)" in format_table(c, "tiny")
    assert "CPU-second" not in format_table(compare("vllm", [4.0], theirs[:1], [[1, 2], [3, 4]]), "tiny")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_process_tree_cpu_counts_a_busy_child() -> None:
    # The child burns CPU until it has used 0.3 s of it, then waits for us to read its tree.
    burn = "import time,sys\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        parent_only = peers.process_tree_cpu_s(child.pid)
        assert parent_only is not None and parent_only >= 0.25
        ours = peers.process_tree_cpu_s(os.getpid())
        assert ours is not None and ours >= parent_only  # our tree includes the child
    finally:
        child.kill()
        child.wait()
    assert peers.process_tree_cpu_s(child.pid) is None  # gone
