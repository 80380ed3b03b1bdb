"""End to end: a size=smoke multirun over two values of two groups writes one result.json per job, and
inferlab-report turns them into the CSV and the report; a job that cannot run records why; the peers,
profile and threads studies on their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pandas as pd
import pytest
from conftest import tiny_model
from omegaconf import OmegaConf

from inferlab.bench.prompts import load_tokenizer
from inferlab.bench.studies.contention import compared, fixed_thread_counts
from inferlab.bench.studies.peers import Peer, prefill_rates
from inferlab.bench.studies.profile import phase_weight_bytes
from inferlab.bench.studies.serving import load_plan, paired_variants
from inferlab.bench.targets import ServerProcess
from inferlab.kernels.build import cpu_gemv_available
from inferlab.kernels.isa import supported_isas
from inferlab.paths import cache_dir, conf_dir
from inferlab.quant.apply import module_bytes, weight_bytes
from inferlab.report.build import build

BIN = Path(sys.executable).parent


def bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    return subprocess.run(
        [str(BIN / "inferlab-bench"), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def one_ok_result(tmp_path: Path, *args: str) -> dict:
    """Run one job into tmp_path; its result.json, which must say ok."""
    run = bench(*args, f"results_root={tmp_path}")
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.rglob("result.json")
    result = json.loads(path.read_text())
    assert result["status"] == "ok", result["error"]
    return result


@pytest.mark.slow
def test_smoke_multirun_then_report(tmp_path: Path):
    run = bench("-m", "sweep=kv_speedup", "size=smoke", "precision=fp32,bf16", f"results_root={tmp_path}")
    assert run.returncode == 0, run.stderr[-2000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.rglob("result.json"))]
    assert len(results) == 4
    assert {(r["choices"]["cache"], r["choices"]["precision"]) for r in results} == {
        ("none", "fp32"),
        ("none", "bf16"),
        ("contiguous", "fp32"),
        ("contiguous", "bf16"),
    }
    for r in results:
        assert r["status"] == "ok", r["error"]
        assert r["env"]["torch_version"] and r["env"]["cpu_model"] and r["env"]["timestamp"]
        assert r["config"]["model"]["name"] == "tiny-random" and r["sweep"] == "kv_speedup"
        assert [row["context_len"] for row in r["rows"]] == r["config"]["measure"]["context_lens"]
        assert all(row["decode_tok_s"] > 0 for row in r["rows"])

    report = build(tmp_path, tmp_path / "report", tmp_path / "REPORT.md")
    frame = pd.read_csv(tmp_path / "report" / "results.csv")
    assert len(frame) == 4 * 2 and (frame.status == "ok").all()
    text = report.read_text()
    for value in frame.decode_tok_s:  # every measured number reaches the report, as formatted from the CSV
        assert any(f"{value:{fmt}}" in text for fmt in (".0f", ".1f", ".2f", ".3g"))
    assert "speedup (contiguous / none)" in text and (tmp_path / "report" / "kv_speedup.png").is_file()


@pytest.mark.slow
def test_a_study_that_cannot_run_records_why(tmp_path: Path):
    run = bench("study=peers", "size=smoke", f"results_root={tmp_path}")  # peers needs GGUF weights
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.rglob("result.json")
    result = json.loads(path.read_text())
    assert result["status"] == "unavailable" and "GGUF" in result["error"] and result["rows"] == []


@pytest.mark.slow
def test_server_target_starts_drives_and_stops_a_real_server(tmp_path: Path):
    run = bench("study=server_latency", "target=server", "size=smoke", "load.concurrency=2", f"results_root={tmp_path}")
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.rglob("result.json")
    result = json.loads(path.read_text())
    assert result["status"] == "ok", result["error"]
    (row,) = result["rows"]
    assert row["completed"] == result["config"]["load"]["num_requests"] and row["failed"] == 0
    assert row["p50_ttft_ms"] > 0 and row["total_output_tokens"] > 0
    log = (path.parent / "server.log").read_text()
    assert "Finished server process" in log  # stopped cleanly when the job ended


@pytest.mark.slow
def test_peers_runs_every_engine_in_the_same_rounds_on_the_default_gguf(tmp_path: Path):
    result = one_ok_result(
        tmp_path,
        "study=peers",
        "size=smoke",
        "model=smollm2-135m",
        "precision=int4",
        "measure.repeats=1",
        "study.prefill_tokens=[32]",
    )
    inferlab = [row for row in result["rows"] if row["engine"] == "inferlab"]
    expected = ["cpu"]
    if cpu_gemv_available():  # the job's own build (auto: the widest) first, then the study's others this CPU runs
        widest = supported_isas()[-1]
        expected = [widest, *(i for i in result["config"]["study"]["isas"] if i in supported_isas() and i != widest)]
    assert [row["isa"] for row in inferlab] == expected
    rows = {row["engine"]: row for row in result["rows"]}
    assert set(rows) == {"inferlab", "transformers", "llama.cpp", "openvino"}
    assert rows["transformers"]["decode_tok_s"] is None and "no int4 path" in rows["transformers"]["note"]
    measured = [row for row in rows.values() if row["decode_tok_s"] is not None]
    assert rows["inferlab"] in measured
    for row in measured:  # the roofline: the bandwidth probed over a buffer of this engine's weight bytes, over them
        assert row["bandwidth_gb_s"] > 0
        assert row["roofline_tok_s"] == pytest.approx(row["bandwidth_gb_s"] * 1e9 / (row["weight_mb"] * 2**20))
        assert row["pct_roofline"] == pytest.approx(100 * row["decode_tok_s"] / row["roofline_tok_s"])
        assert row["prefill_32_tok_s"] > 0  # a prefill column per prompt length, per engine
    assert len({row["bandwidth_gb_s"] for row in inferlab}) == 1  # one weight size, one probe for every build
    # the dequantized copies each inferlab engine keeps for prompts (the peers' are not known)
    assert all(row["dense_copy_mb"] >= 0 for row in inferlab)
    assert all(row.get("dense_copy_mb") is None for row in measured if row["engine"] != "inferlab")
    # the job's own build alone is paired with the same engine at bf16, on the same prompts
    assert inferlab[0]["prefill_32_vs_bf16"] > 0
    assert all("prefill_32_vs_bf16" not in row for row in result["rows"] if row is not inferlab[0])
    if rows["llama.cpp"]["decode_tok_s"] is None:  # llama.cpp's programs are not built here
        assert "make llama-server" in rows["llama.cpp"]["note"]
    else:  # llama-bench on the job's own file
        assert rows["llama.cpp"]["note"].startswith("llama-bench") and rows["llama.cpp"]["note"].endswith("Q4_1.gguf")
    if rows["openvino"]["decode_tok_s"] is None:  # its venv is not made here
        assert "make openvino" in rows["openvino"]["note"]
    else:  # OpenVINO GenAI's pipeline on the job's own file, in its worker process
        assert rows["openvino"]["note"].startswith("OpenVINO GenAI") and "Q4_1.gguf" in rows["openvino"]["note"]


@pytest.mark.slow
@pytest.mark.skipif(not cpu_gemv_available(), reason="no AVX2 CPU or no C++ toolchain here")
def test_peers_add_the_job_at_int8_activation_codes_where_its_precision_takes_them(tmp_path: Path):
    """The row "inferlab int8 codes": the job's engine again at precision.activations=int8, on the job's own build, in
    the same rounds; a precision without int8 codes (bf16) gets no such row."""
    engines = "study.engines=[inferlab,'inferlab int8 codes']"
    common = ("study=peers", "size=smoke", "model=smollm2-135m", "measure.repeats=1", "study.prefill_tokens=[32]")
    result = one_ok_result(tmp_path / "int4", *common, "precision=int4", "study.isas=[]", engines)
    rows = {row["engine"]: row for row in result["rows"]}
    assert set(rows) == {"inferlab", "inferlab int8 codes"}
    assert rows["inferlab int8 codes"]["isa"] == rows["inferlab"]["isa"]
    assert "precision.activations=int8" in rows["inferlab int8 codes"]["note"]
    assert rows["inferlab int8 codes"]["decode_tok_s"] > 0 and rows["inferlab int8 codes"]["prefill_32_tok_s"] > 0
    result = one_ok_result(tmp_path / "bf16", *common, "precision=bf16", "study.isas=[]", engines)
    assert [row["engine"] for row in result["rows"]] == ["inferlab"]


def test_a_paired_prefill_is_timed_beside_ours_in_turns_and_given_as_its_seconds_over_ours():
    calls: list[str] = []

    def timed(name: str, seconds: float) -> Callable[[list[int]], float]:
        def prefill(ids: list[int]) -> float:
            calls.append(f"{name} [{ids[0]}]")
            return seconds

        return prefill

    peer = Peer(lambda ids, n: 0.0, timed("int4", 0.25), 0, "", "amx", ("bf16", timed("bf16", 0.5)))
    prompts = {4: ([1] * 4, [2] * 4), 8: ([1] * 8, [2] * 8)}
    assert prefill_rates(peer, prompts, index=1) == {
        "prefill_4_tok_s": 16.0,
        "prefill_4_vs_bf16": 2.0,
        "prefill_8_tok_s": 32.0,
        "prefill_8_vs_bf16": 2.0,
    }
    # ABBA on the two prompts of each length: both engines on both, neither always first nor always last
    assert calls == ["int4 [1]", "bf16 [1]", "bf16 [2]", "int4 [2]"] + ["int4 [1]", "bf16 [1]", "bf16 [2]", "int4 [2]"]
    calls.clear()
    prefill_rates(peer, prompts, index=2)  # the next round, bf16 is A
    assert calls[:4] == ["bf16 [1]", "int4 [1]", "int4 [2]", "bf16 [2]"]
    calls.clear()
    alone = Peer(peer.decode, peer.prefill, 0, "", "amx")
    assert prefill_rates(alone, prompts, index=1) == {"prefill_4_tok_s": 16.0, "prefill_8_tok_s": 32.0}
    assert calls == ["int4 [1]", "int4 [1]"]  # the first prompt of each length only


def test_the_profile_phases_count_every_weight_of_the_step_once():
    for tied in (False, True):
        model = tiny_model(tie_embeddings=tied)
        norms = sum(module_bytes(m) for name, m in model.named_modules() if name.endswith("norm"))
        embeddings = 0 if tied else module_bytes(model.tok_embeddings)  # a lookup: one row per step, not a phase
        assert sum(phase_weight_bytes(model).values()) + norms + embeddings == weight_bytes(model)


@pytest.mark.slow
def test_profile_gives_the_fused_phases_their_weight_streaming_rate(tmp_path: Path):
    result = one_ok_result(
        tmp_path, "study=profile", "size=smoke", "precision=int8", "study.top_ops=40", "study.sequences=[2,1]"
    )
    one, two = ([row for row in result["rows"] if row["sequences"] == n] for n in (1, 2))  # 1 first, whatever the order
    assert one and two and result["rows"] == one + two
    step_ms = {n: rows[0]["step_ms"] for n, rows in ((1, one), (2, two))}
    assert all(row["step_ms"] == step_ms[row["sequences"]] > 0 for row in one + two)
    ms_with_one = {row["op"]: row["self_ms_per_step"] for row in one}
    for row in two:  # each op against its own cost with one sequence; the ceiling from the whole steps
        assert row["speedup_ceiling"] == pytest.approx(2 * step_ms[1] / step_ms[2])
        if row["op"] in ms_with_one:
            assert row["vs_one_sequence"] == pytest.approx(row["self_ms_per_step"] / ms_with_one[row["op"]])
    assert one[0]["speedup_ceiling"] == pytest.approx(1)
    floor = {}  # what memory allows each step: its working set at the bandwidth a buffer that size reads
    for n, rows in ((1, one), (2, two)):
        memory = {key: rows[0][key] for key in ("working_set_mb", "working_set_gb_s", "memory_floor_ms")}
        assert all({key: row[key] for key in memory} == memory for row in rows)
        assert memory["working_set_mb"] > 0 and memory["working_set_gb_s"] > 0
        assert memory["memory_floor_ms"] == pytest.approx(
            memory["working_set_mb"] * 2**20 / memory["working_set_gb_s"] / 1e6
        )
        floor[n] = memory
    assert floor[2]["working_set_mb"] > floor[1]["working_set_mb"]  # one more sequence's KV
    assert one[0]["memory_ceiling"] == pytest.approx(1)
    assert two[0]["memory_ceiling"] == pytest.approx(2 * floor[1]["memory_floor_ms"] / floor[2]["memory_floor_ms"])
    rows = {row["op"]: row for row in one}
    phases = {op for op in rows if op.startswith("decode_step: ")}
    assert "decode_step: norm+lm_head" in phases and "decode_step: norm+w13" in phases
    for op, row in rows.items():
        streams_weights = op in phases and "attention" not in op
        assert ("weights_gb_s" in row) == streams_weights, op
        if streams_weights:
            assert row["bandwidth_gb_s"] > 0 and row["weights_gb_s"] > 0
            assert row["pct_bandwidth"] == pytest.approx(100 * row["weights_gb_s"] / row["working_set_gb_s"])


@pytest.mark.slow
def test_threads_measures_one_thread_and_all_of_them_side_by_side(tmp_path: Path):
    result = one_ok_result(tmp_path, "study=threads", "size=smoke", "precision=int8", "device.threads=2")
    rows = result["rows"]
    assert [row["threads"] for row in rows] == [1, 2]
    for row in rows:
        assert row["decode_tok_s"] > 0 and row["bandwidth_gb_s"] > 0
        assert row["decode_speedup"] == pytest.approx(row["decode_tok_s"] / rows[0]["decode_tok_s"])
        assert row["bandwidth_speedup"] == pytest.approx(row["bandwidth_gb_s"] / rows[0]["bandwidth_gb_s"])


@pytest.mark.slow
def test_spec_decode_runs_every_drafter_beside_spec_off_in_one_job(tmp_path: Path, monkeypatch):
    kernels = cache_dir() / "kernels"  # the user's: the job loads the kernels this checkout built, no second build
    kernels.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("INFERLAB_CACHE", str(tmp_path / "cache"))  # no trained draft here: its row says why
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    result = one_ok_result(tmp_path, "study=spec_decode", "size=smoke", "spec=self")
    rows = result["rows"]
    (draft,) = [row for row in rows if row["spec"] == "draft"]
    assert draft["decode_tok_s"] is None and "make draft" in draft["note"]
    measured = [row for row in rows if row["spec"] != "draft"]
    assert {(r["spec"], r["temperature"], r["prompts"]) for r in measured} == {
        (s, t, p) for s in ("off", "ngram", "self") for t in (0.0, 0.8) for p in ("chat", "extractive")
    }
    for row in measured:
        assert row["decode_tok_s"] > 0 and row["speedup"] > 0
        assert row["speedup"] == 1.0 if row["spec"] == "off" else row["tokens_per_target_call"] >= 1.0
        assert row["matches_off"] is (True if row["temperature"] == 0.0 and row["spec"] != "off" else None)


@pytest.mark.slow
def test_serving_drives_every_server_over_every_level_in_one_job(tmp_path: Path):
    result = one_ok_result(
        tmp_path, "study=serving", "size=smoke", "model=smollm2-135m", "study.levels=[1,4]", "load.num_requests=2"
    )
    rows = result["rows"]
    vllm = next(row for row in rows if row["server"] == "vllm")
    assert vllm["output_throughput"] is None and "study.vllm_python" in vllm["note"]  # no venv given
    measured = [row for row in rows if row["output_throughput"] is not None]
    servers = {row["server"] for row in measured}
    assert "inferlab" in servers and servers <= {"inferlab", "llama.cpp"}
    for server in servers:
        levels = [row for row in measured if row["server"] == server]
        assert [row["concurrency"] for row in levels] == [1, 4]
        assert [row["requests"] for row in levels] == [2, 4]  # at least one request per stream
        for row in levels:
            assert row["failed"] == 0 and row["median_ttft_ms"] > 0 and row["median_tpot_ms"] > 0
            # every answer runs to its end (llama.cpp's server cuts a stream short when another request waits,
            # unless told not to), so c=4 measures as many tokens per request as c=1
            assert row["output_tokens_per_request"] == levels[0]["output_tokens_per_request"] > 0
            assert row["speedup_vs_c1"] == pytest.approx(row["output_throughput"] / levels[0]["output_throughput"])
    for row in (row for row in measured if row["server"] == "inferlab"):  # its engine's own step profile of the load
        assert row["steps_per_s"] > 0 and row["decode_rows_per_step"] > 0 and row["prompt_rows_per_step"] > 0
        assert 0 < row["forward_ms"] <= row["step_ms"] and row["attention_ms"] <= row["forward_ms"]
        rows_per_step = row["decode_rows_per_step"] + row["prompt_rows_per_step"]
        assert row["forward_ms_per_row"] == pytest.approx(row["forward_ms"] / rows_per_step)
        assert 0 < row["engine_ttft_ms"] and 0 < row["event_loop_cpu_pct"] < row["process_cpu_pct"]
    log = next(path for path in tmp_path.rglob("inferlab.log"))
    assert "precision int4 (auto: the GGUF's Q4_1)" in log.read_text()  # inferlab-serve ran its defaults


def test_every_serving_load_gets_prompts_of_its_own():
    tokenizer = load_tokenizer(dict(OmegaConf.load(conf_dir() / "model" / "smollm2-135m.yaml")))
    load = {**OmegaConf.load(conf_dir() / "load" / "shakespeare.yaml"), "num_requests": 16, "prompt_tokens": 128}
    warmup, rounds = load_plan(tokenizer, load, [1, 4, 8, 16, 32], rounds=3, warmup=1, seed=0)
    assert len(warmup) == 1 and len(rounds) == 3
    assert all([len(r[c]) for c in (1, 4, 8, 16, 32)] == [16, 16, 16, 16, 32] for r in rounds)
    prompts = warmup + [p for r in rounds for level in r.values() for p in level]
    assert all(len(p.token_ids) == 128 for p in prompts)
    # no two begin with the same block of 16 tokens: none finds another's blocks in a prefix cache
    assert len({tuple(p.token_ids[:16]) for p in prompts}) == len(prompts) == 1 + 3 * 96


def test_each_variant_is_paired_with_the_one_differing_only_by_the_paired_override():
    variants = [["precision=bf16", "spec=off"], ["precision=bf16", "spec=self"], ["precision=fp32", "spec=self"]]
    assert paired_variants(variants, "spec=off") == {
        "inferlab precision=bf16 spec=off": ("vs_spec_off", "inferlab precision=bf16 spec=off"),
        "inferlab precision=bf16 spec=self": ("vs_spec_off", "inferlab precision=bf16 spec=off"),
    }  # fp32 spec=self has no fp32 spec=off beside it: no column
    assert paired_variants(variants, None) == {}


@pytest.mark.slow
def test_serving_spec_drives_spec_off_and_self_at_one_precision_in_one_job(tmp_path: Path):
    variants = "[['precision=fp32','spec=off'],['precision=fp32','spec=self']]"
    result = one_ok_result(
        tmp_path,
        "study=serving_spec",
        "size=smoke",
        f"study.inferlab_variants={variants}",
        "study.levels=[1,2]",
        "load.num_requests=2",
    )
    rows = result["rows"]
    servers = [f"inferlab precision=fp32 spec={spec}" for spec in ("off", "self")]
    assert [(row["server"], row["concurrency"]) for row in rows] == [(s, c) for s in servers for c in (1, 2)]
    for row in rows:
        assert row["failed"] == 0 and row["output_throughput"] > 0 and row["median_ttft_ms"] > 0
        assert row["output_tokens_per_request"] == rows[0]["output_tokens_per_request"] > 0  # whole answers, both
        # load by load over spec off's: 1 for spec off itself (its own loads), a positive ratio for spec=self
        assert row["vs_spec_off"] == 1.0 if row["server"].endswith("spec=off") else row["vs_spec_off"] > 0
        # the engine's speculation counters over the same loads, from the speculating server alone
        assert ("tokens_per_target_call" in row) == row["server"].endswith("spec=self")
    for row in (row for row in rows if row["server"].endswith("spec=self")):
        assert row["tokens_per_target_call"] >= 1 and row["drafts_per_round"] >= 0
        assert 0 <= row["spec_acceptance"] <= 1
    logs = {
        spec: (result_dir(tmp_path) / f"inferlab_precision=fp32_spec={spec}.log").read_text()
        for spec in ("off", "self")
    }
    assert (
        "spec=self (K <= " in logs["self"] and "spec=" not in logs["off"].split("precision fp32", 1)[1].split("\n")[0]
    )


@pytest.mark.slow
def test_serving_loads_a_server_already_running_at_a_url(tmp_path: Path):
    """study.endpoints: a server the study neither starts nor pauses (a cluster's endpoint), loaded like the rest."""
    overrides = ["model=tiny-random", "server.rate_limit=1000000/minute"]
    with ServerProcess([sys.executable, "-m", "inferlab.serve"], overrides, "127.0.0.1", 180, tmp_path / "log") as url:
        result = one_ok_result(
            tmp_path / "results",
            "study=serving",
            "size=smoke",
            "study.servers=[]",
            f"study.endpoints=[{{name:cluster,url:'{url}'}}]",
            "study.levels=[1,2]",
            "load.num_requests=2",
        )
        served = httpx.get(f"{url}/v1/metrics", timeout=10).json()["requests_completed"]
    rows = result["rows"]
    assert [(row["server"], row["concurrency"]) for row in rows] == [("cluster", 1), ("cluster", 2)]
    for row in rows:
        assert row["failed"] == 0 and row["output_throughput"] > 0 and row["output_tokens_per_request"] == 4
        assert row["weights"] == f"already running at {url}" and "steps_per_s" not in row  # not its to profile
    assert served == 1 + 2 + 2  # the warm-up request, then each level's two: all of them on that server


@pytest.mark.slow
def test_contention_measures_each_engine_quiet_and_under_a_quota_beside_a_fixed_thread_count(tmp_path: Path):
    result = one_ok_result(
        tmp_path,
        "study=contention",
        "size=smoke",
        "study.conditions=[quiet,quota]",  # the neighbor condition's own test: tests/test_contention.py
        "study.fixed_threads=[1]",
        "study.fixed_threads_under=[quota]",  # the fewest servers that show the comparison
        "study.levels=[1,2]",
        "load.num_requests=2",
    )
    rows = result["rows"]
    llama = rows.pop(0)  # the tiny model has no GGUF file for it
    assert llama["engine"] == "llama.cpp" and llama["tok_s"] is None and "GGUF" in llama["note"]
    loads = ["decode", "serving c=1", "serving c=2"]
    runs = [("inferlab", "quiet"), ("inferlab", "quota"), ("inferlab device.threads=1", "quota")]
    assert sorted((r["engine"], r["condition"], r["load"]) for r in rows) == sorted(
        (engine, condition, load) for engine, condition in runs for load in loads
    )
    by = {(r["engine"], r["condition"], r["load"]): r for r in rows}
    for row in rows:
        assert row["tok_s"] > 0
        if row["load"] != "decode":
            assert row["failed"] == row["timed_out"] == 0 and row["median_ttft_ms"] > 0
        quiet = by.get((row["engine"], "quiet", row["load"]))
        assert row["vs_quiet"] == (pytest.approx(row["tok_s"] / quiet["tok_s"]) if quiet else None)
        fixed = by.get(("inferlab device.threads=1", row["condition"], row["load"]))
        beside = row["engine"] == "inferlab" and fixed is not None
        assert row["vs_best_fixed"] == (pytest.approx(row["tok_s"] / fixed["tok_s"]) if beside else None)
    quota = {r["mechanism"] for r in rows if r["condition"] == "quota"}
    assert len(quota) == 1 and quota.pop().startswith(("cgroup v", "affinity to"))
    assert by["inferlab device.threads=1", "quota", "decode"]["threads"] == 1


def test_contention_compares_the_defaults_with_the_fastest_fixed_thread_count():
    def row(engine: str, condition: str, tok_s: float | None) -> dict:
        return {"engine": engine, "load": "decode", "condition": condition, "tok_s": tok_s}

    rows = compared(
        [
            row("inferlab", "quiet", 100.0),
            row("inferlab", "quota", 40.0),
            row("inferlab device.threads=1", "quota", 50.0),
            row("inferlab device.threads=2", "quota", 20.0),
            row("llama.cpp", "quota", 30.0),  # no quiet row of its own
            row("llama.cpp", "neighbor", None),  # a run that did not finish in its time
        ]
    )
    assert [(r["vs_quiet"], r["vs_best_fixed"]) for r in rows] == [
        (1.0, None),
        (0.4, 0.8),  # over threads=1's, the faster
        (None, None),
        (None, None),
        (None, None),
        (None, None),
    ]
    assert fixed_thread_counts(None, 2) == [1, 2] and fixed_thread_counts(None, 16) == [8, 16]
    assert fixed_thread_counts([3, 1, 3], 16) == [1, 3]


def result_dir(tmp_path: Path) -> Path:
    (path,) = tmp_path.rglob("result.json")
    return path.parent


@pytest.mark.slow
def test_structured_runs_free_and_json_schema_requests_at_each_level_in_one_job(tmp_path: Path):
    result = one_ok_result(tmp_path, "study=structured", "size=smoke")
    rows = {(row["concurrency"], row["mode"]): row for row in result["rows"]}
    assert set(rows) == {(c, m) for c in (1, 8) for m in ("free", "json_schema")}
    for (level, mode), row in rows.items():
        assert row["completed"] == max(4, 2 * level) and row["median_tpot_ms"] > 0
        assert 0 <= row["valid_pct"] <= 100 and row["length_pct"] == 100  # 4 new tokens: no JSON finishes
        assert row["tpot_vs_free"] == 1.0 if mode == "free" else row["tpot_vs_free"] > 0
