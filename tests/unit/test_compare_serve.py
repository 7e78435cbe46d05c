"""``kvserve bench compare-serve`` without vLLM: command lines, result parsing, the table's ratios, process
cleanup, and the whole round loop against fake ``vllm`` / ``vllm-router`` executables.

The fakes are small Python scripts laid out as ``setup_peers.sh`` lays out the real venvs: ``vllm serve``
answers ``/health`` and ``/v1/models`` (and leaves a grandchild in a session of its own, as Ray's and
vLLM's helpers do), ``vllm bench serve`` writes a result file with chosen figures, ``vllm-router`` lists
its first worker's models. Each records its argv, so identical client arguments and the alternating
order can be checked, and every pid, so the test can check that nothing outlives the bench.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvserve.cluster.bench import compare_serve, serve_targets
from kvserve.cluster.bench.compare_serve_clients import (
    BenchSpec,
    cpu_description,
    guidellm_scenario,
    vllm_bench_command,
)
from kvserve.cluster.bench.compare_serve_report import (
    ClientResult,
    ResultError,
    format_table,
    parse_guidellm,
    parse_vllm_bench,
    summarize,
)
from kvserve.cluster.bench.procs import ServerError, ServerProcess, wait_http_ready
from kvserve.cluster.cli import main

SPEC = BenchSpec(model="/m/smol", tokenizer="/m/smol", workload="random", num_prompts=64, max_concurrency=16, seed=3)


def _vllm_result(tok_s: float, ttft: float = 100.0, completed: int = 64) -> dict:
    return {"completed": completed, "failed": 0, "output_throughput": tok_s, "median_ttft_ms": ttft,
            "p90_ttft_ms": 2 * ttft, "median_tpot_ms": 50.0, "median_itl_ms": 40.0, "duration": 10.0}  # fmt: skip


# ---- command lines ---------------------------------------------------------------------------------
def test_vllm_bench_command_is_identical_for_every_target_but_the_url(tmp_path: Path) -> None:
    a = vllm_bench_command("vllm", "http://127.0.0.1:1", SPEC, tmp_path / "r.json")
    b = vllm_bench_command("vllm", "http://127.0.0.1:2", SPEC, tmp_path / "r.json")
    assert [x for x in a if "127.0.0.1" not in x] == [x for x in b if "127.0.0.1" not in x]
    s = " ".join(a)
    for part in ("bench serve --backend openai", "--dataset-name random", "--num-prompts 64", "--max-concurrency 16",
                 "--seed 3", "--temperature 0", "--ignore-eos", "--random-input-len 256", "--random-output-len 64",
                 "--metric-percentiles 50,90,99", "--save-detailed", f"--result-dir {tmp_path}",
                 "--result-filename r.json", "--model /m/smol --tokenizer /m/smol"):  # fmt: skip
        assert part in s, part
    prefix = " ".join(vllm_bench_command("vllm", "u", BenchSpec(**{**SPEC.__dict__, "workload": "prefix_repetition"}),
                                         tmp_path / "r.json"))  # fmt: skip
    assert "--dataset-name prefix_repetition" in prefix and "--prefix-repetition-prefix-len 512" in prefix
    assert "--prefix-repetition-num-prefixes 8" in prefix and "--random-input-len" not in prefix
    with pytest.raises(ValueError, match="unknown workload"):
        vllm_bench_command("vllm", "u", BenchSpec(**{**SPEC.__dict__, "workload": "sharegpt"}), tmp_path / "r.json")


def test_guidellm_scenario_is_greedy_with_the_same_lengths(tmp_path: Path) -> None:
    spec = guidellm_scenario("http://h:1", SPEC, tmp_path / "g.json")["spec"]
    assert spec["backend"]["extras"] == {"body": {"temperature": 0}}
    assert spec["backend"]["request_format"] == "/v1/completions" and spec["backend"]["model"] == "/m/smol"
    assert spec["data"] == [{"kind": "synthetic_text", "prompt_tokens": 256, "output_tokens": 64}]
    assert spec["profile"]["streams"] == [16] and spec["constraints"][0]["count"] == 64
    with pytest.raises(ValueError):
        guidellm_scenario("u", BenchSpec(**{**SPEC.__dict__, "workload": "prefix_repetition"}), tmp_path / "g.json")


def test_targets_command_lines() -> None:
    kv = serve_targets.kvserve_target("/m", "/m", workers=2, cpus_per_worker=1, extra=["--block-size=4"])
    argv = kv.procs[0].argv
    assert argv[1:4] == ["-m", "kvserve.cluster.cli", "serve"]
    assert "--http-port" in argv and argv[-1] == "--block-size=4"
    assert argv[argv.index("--workers") + 1] == "2" and argv[argv.index("--metrics-port") + 1] == "off"
    assert kv.procs[0].log_marker == serve_targets.KVSERVE_READY_LINE
    two = serve_targets.vllm_router_target("vllm", "vllm-router", "/m", "/m", "prefix_repetition", 2.0)
    e0, e1, router = two.procs
    assert [e0.env["VLLM_CPU_OMP_THREADS_BIND"], e1.env["VLLM_CPU_OMP_THREADS_BIND"]] == ["0", "1"]
    assert e0.start_with_next and not e1.start_with_next and e0.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert e0.argv[:3] == ["vllm", "serve", "/m"] and "float32" in e0.argv and "--served-model-name" in e0.argv
    assert router.argv[router.argv.index("--policy") + 1] == "cache_aware"
    assert router.argv[-2:] == [e0.url, e1.url] and two.base_url == router.url
    assert len({e0.port, e1.port, router.port}) == 3
    rr = serve_targets.vllm_router_target("vllm", "vllm-router", "/m", "/m", "random", 2.0).procs[-1].argv
    assert rr[rr.index("--policy") + 1] == "round_robin"


def test_round_order_alternates() -> None:
    assert [compare_serve.round_order([1, 2, 3], i) for i in range(3)] == [[1, 2, 3], [3, 2, 1], [1, 2, 3]]


def test_cpu_description() -> None:
    text = "model name\t: AMD EPYC 9B45\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\nmodel name\t: other\n"
    assert cpu_description(text) == ("AMD EPYC 9B45", "avx2 fma avx512f avx512_bf16")
    assert cpu_description("") == ("unknown CPU", "no AVX2")


# ---- results, medians, ratios ------------------------------------------------------------------------
def test_parse_vllm_bench() -> None:
    r = parse_vllm_bench(_vllm_result(75.0))
    assert r == ClientResult(75.0, 100.0, 200.0, 50.0, 40.0, completed=64, failed=0)
    with pytest.raises(ResultError, match="p90_ttft_ms"):
        parse_vllm_bench({k: v for k, v in _vllm_result(1.0).items() if k != "p90_ttft_ms"})
    with pytest.raises(ResultError, match="no request completed"):
        parse_vllm_bench(_vllm_result(1.0, completed=0))


def test_parse_guidellm() -> None:
    def stat(median: float, p90: float, mean: float = 0.0) -> dict:
        return {"median": median, "mean": mean, "percentiles": {"p50": median, "p90": p90}}

    metrics = {
        "request_totals": {"successful": 62, "errored": 1, "incomplete": 1, "total": 64},
        "output_tokens_per_second": {"total": stat(0, 0, mean=59.7), "successful": stat(0, 0, mean=1.0)},
        "time_to_first_token_ms": {"successful": stat(3900, 5000)},
        "time_per_output_token_ms": {"successful": stat(190, 200)},
        "inter_token_latency_ms": {"successful": stat(188, 199)},
    }
    r = parse_guidellm({"benchmarks": [{"metrics": metrics}]})
    assert r == ClientResult(59.7, 3900, 5000, 190, 188, completed=62, failed=2)
    with pytest.raises(ResultError, match="no benchmark"):
        parse_guidellm({"benchmarks": []})
    del metrics["inter_token_latency_ms"]
    with pytest.raises(ResultError, match="inter_token_latency_ms"):
        parse_guidellm({"benchmarks": [{"metrics": metrics}]})


def test_summary_medians_and_ratios() -> None:
    def run(tok_s: float, ttft: float) -> ClientResult:
        return ClientResult(tok_s, ttft, 2 * ttft, 100.0, 90.0, 64, 0)

    summary = summarize({
        "kvserve": [run(70, 2000), run(80, 3000), run(75, 1000)],
        "vllm": [run(60, 6000), run(64, 5000), run(66, 4000)],
    })  # fmt: skip
    assert summary["kvserve"]["median"]["output_tokens_per_s"] == 75
    assert summary["vllm"]["ratio"]["output_tokens_per_s"] == pytest.approx(75 / 64)
    assert summary["vllm"]["ratio"]["ttft_p50_ms"] == pytest.approx(2000 / 5000)
    assert summary["vllm"]["round_ratios"] == pytest.approx([70 / 60, 80 / 64, 75 / 66])
    assert "ratio" not in summary["kvserve"]
    table = format_table(summary, "t")
    assert "| kvserve | 75.0 (70.0, 80.0, 75.0) | 2000 | 4000 | 100 | 90.0 | 0 |" in table
    assert "| kvserve / vllm | 1.17x | 0.40x |" in table
    assert "ratio" not in summarize({"vllm": [run(1, 1)]})["vllm"]  # no kvserve: no ratios


# ---- processes ----------------------------------------------------------------------------------------
# A server that ignores SIGTERM (as a stuck one would) and leaves a grandchild in a session of its own.
STUBBORN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
    """
)


def _wait_file(path: Path) -> str:
    for _ in range(200):
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} not written")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_kills_the_group_and_descendants_that_left_it(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(STUBBORN)
    server = ServerProcess("stubborn", [sys.executable, str(tmp_path / "s.py"), str(tmp_path / "pids")],
                           tmp_path / "s.log", grace_s=0.5)  # fmt: skip
    pids = [int(x) for x in _wait_file(tmp_path / "pids").split()]
    server.remember_children()
    assert server.stop() is None  # it ignored SIGTERM: killed
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids), pids
    assert server.stop() == -signal.SIGKILL  # idempotent: a second call reports the kill


def test_stop_lets_a_polite_server_exit(tmp_path: Path) -> None:
    with ServerProcess("polite", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "p.log") as s:
        pass
    assert s.proc.returncode == -signal.SIGTERM


def test_wait_http_ready_names_the_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('cannot bind'); raise SystemExit(3)"]
    dead = ServerProcess("dead", argv, tmp_path / "d.log")
    with pytest.raises(ServerError, match=r"dead exited with status 3.*d\.log(.|\n)*cannot bind"):
        wait_http_ready(dead, "http://127.0.0.1:9/health", timeout_s=30, poll_s=0.05)
    dead.stop()
    with ServerProcess("slow", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log") as slow:
        with pytest.raises(ServerError, match=r"slow was not ready .* within 0 s; log .*s\.log"):
            wait_http_ready(slow, "http://127.0.0.1:9/health", timeout_s=0.2, poll_s=0.05)


# ---- the whole loop against fakes ----------------------------------------------------------------------
FAKE_VLLM = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys, urllib.request
    log = os.environ["FAKE_LOG"]
    def note(**kw):
        with open(log, "a") as f:
            f.write(json.dumps(kw) + "\\n")
    argv = sys.argv[1:]
    def opt(name):
        return argv[argv.index(name) + 1]
    name = os.path.basename(sys.argv[0])
    if name == "vllm" and argv[:2] == ["bench", "serve"]:
        note(kind="bench", argv=argv)
        if os.environ.get("FAKE_BENCH_SLEEP"):
            import time
            time.sleep(float(os.environ["FAKE_BENCH_SLEEP"]))
        import time
        burn = float(os.environ.get("FAKE_BENCH_BURN", "0"))
        t0 = time.process_time()
        while time.process_time() - t0 < burn:  # the client's own CPU, for the CPU-by-role table
            pass
        time.sleep(1.2 if burn else 0)  # NOTE: compare-serve samples every 0.5 s, as long as the client runs
        tok_s = float(os.environ["FAKE_TOK_S"])
        res = {"completed": 4, "failed": 0, "output_throughput": tok_s, "median_ttft_ms": 10.0, "p90_ttft_ms": 20.0,
               "median_tpot_ms": 5.0, "median_itl_ms": 5.0, "duration": 2 * burn or 1.0}
        open(os.path.join(opt("--result-dir"), opt("--result-filename")), "w").write(json.dumps(res))
        sys.exit(0)
    if name == "vllm":
        served = opt("--served-model-name")
    else:  # vllm-router: lists its first worker's models
        served = json.load(urllib.request.urlopen(opt("--worker-urls") + "/v1/models"))["data"][0]["id"]
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    note(kind=name, argv=argv, pid=os.getpid(), helper=helper.pid, bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": served}]}).encode()
            self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(opt("--port"))), H).serve_forever()
    """
)


def _fake_peers(tmp_path: Path) -> Path:
    """``<tmp>/peers/{vllm,vllm-router}/bin/...`` as setup_peers.sh lays them out; returns the peer python."""
    for venv, exe in (("vllm", "vllm"), ("vllm-router", "vllm-router")):
        bin_dir = tmp_path / "peers" / venv / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / exe).write_text(f"#!{sys.executable}\n{FAKE_VLLM}")
        (bin_dir / exe).chmod(0o755)
    python = tmp_path / "peers" / "vllm" / "bin" / "python"
    python.symlink_to(sys.executable)
    return python


def test_compare_serve_rounds_against_fake_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    python = _fake_peers(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    log = tmp_path / "fake.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_TOK_S", "50")
    monkeypatch.setenv("FAKE_BENCH_BURN", "0.4")
    status = main(["bench", "compare-serve", "--peer-python", str(python), "--model", str(model), "--runs", "2",
                   "--targets", "vllm,vllm-router", "--workload", "prefix_repetition", "--json",
                   "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "60"])  # fmt: skip
    out = capsys.readouterr()
    assert status == 0, out.err
    report = json.loads(out.out)
    table = report["clients"]["vllm bench serve"]
    assert [len(table[t]["rounds"]) for t in ("vllm", "vllm-router")] == [2, 2]
    assert table["vllm"]["median"]["output_tokens_per_s"] == 50.0
    # CPU by role while the client ran: the fake client burned 0.4 s of a 0.8 s "benchmark"
    cpu = report["cpu"]
    assert [len(cpu[t]["rounds"]) for t in ("vllm", "vllm-router")] == [2, 2]
    for t in ("vllm", "vllm-router"):
        cores = cpu[t]["median_cores"]
        # NOTE: machine-wide sums: other work's clients count too, so only lower bounds hold here
        assert cores["client"] > 0 and cores["all"] >= cores["client"], cores
    # NOTE: the machine may be busy with other work (engines, clients of its own): find the fake client's
    # process by its command line, not as the busiest, and read its own CPU time, not the machine's share.
    logged = json.loads((tmp_path / "logs" / "round-1" / "vllm" / "cpu.json").read_text())["processes"]
    ours = [p for p in logged if str(tmp_path / "peers") in p["cmdline"] and "bench serve" in p["cmdline"]]
    assert len(ours) == 1 and ours[0]["role"] == "client", logged
    assert 0.35 <= ours[0]["cpu_s"] <= 0.75, ours
    events = [json.loads(line) for line in log.read_text().splitlines()]
    servers = [e for e in events if e["kind"] != "bench"]
    # round 1: vllm, then the two engines and the router; round 2 the other way round
    assert [e["kind"] for e in servers] == ["vllm", "vllm", "vllm", "vllm-router"] * 1 + [
        "vllm", "vllm", "vllm-router", "vllm"]  # fmt: skip
    assert sorted(e["bind"] for e in servers[1:3]) == ["0", "1"] and servers[0]["bind"] is None
    assert "cache_aware" in servers[3]["argv"]
    benches = [e["argv"] for e in events if e["kind"] == "bench"]
    assert len(benches) == 4
    def strip(argv: list[str]) -> list[str]:  # all but the target's URL and where the result goes
        drop = {i + 1 for i, a in enumerate(argv) if a in ("--base-url", "--result-dir")}
        return [a for i, a in enumerate(argv) if i not in drop]

    assert all(strip(b) == strip(benches[0]) for b in benches), "every target gets the same client arguments"
    time.sleep(0.2)
    leftovers = [p for e in servers for p in (e["pid"], e["helper"]) if _alive(p)]
    assert not leftovers, "compare-serve left processes behind"


def test_compare_serve_interrupted_stops_every_server(tmp_path: Path) -> None:
    """SIGINT (and SIGTERM) while a client runs: exit 130, and every server and helper is gone."""
    python = _fake_peers(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    log = tmp_path / "fake.log"
    env = {**os.environ, "FAKE_LOG": str(log), "FAKE_TOK_S": "1", "FAKE_BENCH_SLEEP": "60"}
    for sig in (signal.SIGINT, signal.SIGTERM):
        log.write_text("")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cluster.bench.compare_serve", "--peer-python", str(python),
             "--model", str(model),
             "--targets", "vllm-router", "--log-dir", str(tmp_path / f"logs-{sig}")],
            cwd=Path(__file__).resolve().parents[2], env=env, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for _ in range(600):
            if '"bench"' in log.read_text():
                break
            time.sleep(0.05)
        else:
            proc.kill()
            raise AssertionError(f"the client never started: {proc.communicate()[1]}")
        proc.send_signal(sig)
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == 130, err
        time.sleep(0.2)
        servers = [json.loads(line) for line in log.read_text().splitlines() if '"bench"' not in line]
        assert len(servers) == 3
        assert not [p for e in servers for p in (e["pid"], e["helper"]) if _alive(p)], sig


def test_compare_serve_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    python = _fake_peers(tmp_path)
    assert main(["bench", "compare-serve", "--model", str(tmp_path), "--peer-python", str(python)]) == 2
    assert "config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["bench", "compare-serve", "--model", str(tmp_path), "--peer-python", str(python),
                 "--targets", "kvserve,sglang"]) == 2  # fmt: skip
    assert "sglang" in capsys.readouterr().err
    os.environ.pop("KVSERVE_PEER_PYTHON", None)
    assert main(["bench", "compare-serve", "--model", str(tmp_path)]) == 2
    assert "--peer-python" in capsys.readouterr().err


def test_plan_skips_a_missing_router(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    python = _fake_peers(tmp_path)
    args = argparse.Namespace(targets="vllm,vllm-router", model="/m", workers=None, cpus_per_worker=None,
                              kvserve_arg=[], vllm_arg=[], vllm_kv_cache_gib=1.0, router_bin=str(tmp_path / "nope"),
                              peer_python=str(python), workload="random")  # fmt: skip
    assert [t.name for t in compare_serve.plan_targets(args, "vllm", "/m")] == ["vllm"]
    assert "no vllm-router" in capsys.readouterr().err
    args.router_bin = None
    assert [t.name for t in compare_serve.plan_targets(args, "vllm", "/m")] == ["vllm", "vllm-router"]


def test_setup_script_parses() -> None:
    script = Path(__file__).resolve().parents[2] / "kvserve" / "cluster" / "bench" / "setup_peers.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "+cpu" in text and "vllm-router" in text and "guidellm" in text
