"""inferlab-report on a fixture of result.json files: CSV, charts, sections, newest-wins, and the notebook."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient
from omegaconf import OmegaConf

from inferlab.paths import conf_dir
from inferlab.report.build import build
from inferlab.report.collect import collect
from inferlab.report.targets import target_table

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"
CONF = conf_dir()


def write(
    root: Path,
    name: str,
    study: str,
    overrides: list[str],
    rows: list[dict],
    status: str = "ok",
    error: str | None = None,
    timestamp: str = "2026-01-01T00:00:00+00:00",
) -> None:
    choices = {
        "model": "tiny-random",
        "precision": "fp32",
        "cache": "contiguous",
        "spec": "off",
        "target": "engine",
        "load": "shakespeare",
        "device": "auto",
    }
    choices.update(dict(o.split("=", 1) for o in overrides if o.split("=")[0] in choices))
    result = {
        "study": study,
        "sweep": study,
        "status": status,
        "error": error,
        "seconds": 1.0,
        "overrides": overrides,
        "choices": choices,
        "config": {"measure": {"size": "smoke"}},
        "env": {"timestamp": timestamp, "cpu_model": "Test CPU", "torch_threads": 2, "git_commit": "abc"},
        "rows": rows,
    }
    (root / name).mkdir(parents=True)
    (root / name / "result.json").write_text(json.dumps(result))


@pytest.fixture
def outputs(tmp_path: Path) -> Path:
    root = tmp_path / "outputs"
    write(
        root,
        "kv/0",
        "kv_speedup",
        ["cache=none"],
        [{"context_len": 4, "decode_tok_s": 2.0}, {"context_len": 8, "decode_tok_s": 1.0}],
    )
    write(
        root,
        "kv/1",
        "kv_speedup",
        ["cache=contiguous"],
        [{"context_len": 4, "decode_tok_s": 9.0}, {"context_len": 8, "decode_tok_s": 8.5}],
    )
    write(
        root,
        "kv/old",
        "kv_speedup",
        ["cache=contiguous"],
        [{"context_len": 4, "decode_tok_s": 99.0}],
        timestamp="2025-01-01T00:00:00+00:00",
    )  # superseded by kv/1
    write(
        root,
        "peers/0",
        "peers",
        ["precision=fp32"],
        [
            {"engine": "inferlab", "decode_tok_s": 50.0, "pct_roofline": 40.0, "note": "x"},
            {"engine": "transformers", "decode_tok_s": 25.0, "pct_roofline": 20.0, "note": "y"},
        ],
    )
    write(
        root,
        "quant/int8",
        "quant_tradeoff",
        ["precision=int8"],
        [],
        status="unavailable",
        error="precision=int8 is not available yet",
    )
    write(root, "batch/0", "batching", ["load.concurrency=4"], [], status="error", error="RuntimeError: boom")
    return root


def test_report_is_built_from_the_csv(outputs: Path, tmp_path: Path):
    report_dir, report_file = tmp_path / "outputs" / "report", tmp_path / "REPORT.md"
    build(outputs, report_dir, report_file)
    frame = pd.read_csv(report_dir / "results.csv")
    assert 99.0 not in frame.decode_tok_s.tolist()  # the older duplicate job is dropped
    assert set(frame.study) == {"kv_speedup", "peers", "quant_tradeoff", "batching"}
    text = report_file.read_text()
    kv = text.split("## KV-cache speedup")[1].split("\n## ")[0]
    assert "| 4 " in kv and "| 4.50 " in kv and "| 8.50 " in kv  # 9 / 2 = 4.5 speedup at 4 tokens, 8.5 / 1 at 8
    assert "![KV-cache speedup vs context length](outputs/report/kv_speedup.png)" in kv
    assert (report_dir / "kv_speedup.png").stat().st_size > 0 and (report_dir / "peers.png").is_file()
    assert "| fp32 " in text and "transformers" in text and "Test CPU" in text
    hardware = text.split("## Hardware and software")[1].split("\n## ")[0]
    assert "| studies " in hardware and "| kv_speedup, peers " in hardware  # which studies ran where (ok ones)
    quant = text.split("## Precision vs memory")[1].split("\n## ")[0]
    assert "Not available yet" in quant and "precision=int8 is not available yet" in quant
    assert "RuntimeError: boom" in text.split("## Batching")[1].split("\n## ")[0]
    assert "Not run yet: `inferlab-bench -m sweep=spec_decode`" in text
    assert "inferlab-bench -m sweep=kv_speedup size=smoke" in text


def test_collect_keeps_one_line_per_row_and_jobs_without_rows(outputs: Path):
    frame = collect(outputs)
    assert len(frame[frame.study == "kv_speedup"]) == 4 and len(frame[frame.study == "peers"]) == 2
    assert frame[frame.study == "quant_tradeoff"].precision.tolist() == ["int8"]


def test_a_rerun_elsewhere_replaces_only_what_it_measured_again(outputs: Path, tmp_path: Path):
    """The committed CSV stands for the result.json files of the machine that measured them: on a fresh clone,
    rerunning one configuration replaces its rows and keeps every other's, and a stale result.json loses."""
    first = build(outputs, outputs / "report", tmp_path / "REPORT.md")
    committed = pd.read_csv(outputs / "report" / "results.csv")
    clone = tmp_path / "clone" / "outputs"
    (clone / "report").mkdir(parents=True)
    (clone / "report" / "results.csv").write_bytes((outputs / "report" / "results.csv").read_bytes())
    newer, older = "2026-02-01T00:00:00+00:00", "2025-06-01T00:00:00+00:00"
    write(
        clone, "peers/0", "peers", ["precision=fp32"], [{"engine": "inferlab", "decode_tok_s": 77.0}], timestamp=newer
    )
    write(clone, "kv/1", "kv_speedup", ["cache=contiguous"], [{"context_len": 4, "decode_tok_s": 1.0}], timestamp=older)
    for _ in range(2):  # a second build reads its own CSV back: the same rows, none twice
        report = build(clone, clone / "report", tmp_path / "CLONE.md").read_text()
        frame = pd.read_csv(clone / "report" / "results.csv")
        assert frame[frame.study == "peers"].decode_tok_s.tolist() == [77.0]
        kept = frame[frame.study != "peers"].drop(columns="job").reset_index(drop=True)
        expected = committed[committed.study != "peers"].drop(columns="job").reset_index(drop=True)
        pd.testing.assert_frame_equal(kept[expected.columns], expected, check_dtype=False)
    assert "4 of them read back from that CSV" in report and "read back" not in first.read_text()


def notebook_images(outputs: Path, monkeypatch, timeout: int) -> list[dict]:
    """Run the report notebook on `outputs`; the PNG outputs of its cells."""
    monkeypatch.setenv("INFERLAB_OUTPUTS", str(outputs))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    return [o for c in cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]


def test_notebook_runs_on_the_fixture(outputs: Path, monkeypatch):
    assert len(notebook_images(outputs, monkeypatch, timeout=120)) == 2  # kv_speedup and peers have charts and rows


def test_perplexity_delta_against_fp32_comes_from_the_csv(tmp_path: Path):
    root = tmp_path / "outputs"
    for precision, ppl in (("fp32", 20.0), ("int8", 20.5), ("int4", 21.0)):
        write(
            root,
            f"q/{precision}",
            "quant_tradeoff",
            [f"precision={precision}"],
            [{"batch_size": b, "weight_mb": 1.0, "gen_tok_s": 1.0, "perplexity": ppl} for b in (1, 8)],
        )
    build(root, tmp_path / "report", tmp_path / "REPORT.md")
    quant = (tmp_path / "REPORT.md").read_text().split("## Precision vs memory")[1].split("\n## ")[0]
    assert "perplexity vs fp32 (%)" in quant
    rows = {
        line.split("|")[1].strip() + line.split("|")[2].strip(): line
        for line in quant.splitlines()
        if line.startswith("| int") or line.startswith("| fp32")
    }
    assert "| 2.50 " in rows["int81"] and "| 5.00 " in rows["int48"] and "| 0 " in rows["fp321"]


def test_readme_quotes_the_headline_sections_of_the_report(outputs: Path, tmp_path: Path):
    from inferlab.report.build import README_END, README_START, embed_headline

    report_file = build(outputs, tmp_path / "report", tmp_path / "REPORT.md")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nintro\n\n{README_START}\nstale numbers\n{README_END}\n\n## Later\n")
    assert embed_headline(readme, report_file, ["kv_speedup", "peers"])
    text = readme.read_text()
    assert "stale numbers" not in text and text.startswith("# x\n\nintro") and text.endswith("## Later\n")
    kv = text.split("### KV-cache speedup")[1].split("###")[0]
    assert "| 4.50 " in kv and "(report/kv_speedup.png)" in kv  # the report's own table and chart
    assert "transformers" in text.split(README_START)[1]
    assert not embed_headline(tmp_path / "REPORT.md", report_file, ["peers"])  # no markers: left alone


COMMITTED_CSV = NOTEBOOK.parents[1] / "outputs" / "report" / "results.csv"
README = NOTEBOOK.parents[1] / "README.md"
REPORT = NOTEBOOK.parents[1] / "INFERENCE_BENCHMARK_REPORT.md"
# What a measured figure typed into prose looks like: a ratio (1.9x), a rate, a time, a share, a divergence, a count
# of tokens kept or tests passed, an approximate figure, a figure set against another, a torch build a run used.
MEASURED = [
    r"\d(\.\d+)?\s?x\b",
    r"\d\s?(tok/s|tokens/s|tokens per second|[GM]B/s|GiB/s)",
    r"\d\s?(ms|us|µs|s|seconds?|minutes?|hours?)\b",
    r"\d\s?%",
    r"\b(KL|cosine|perplexity|ppl)\s*(of\s*)?[<>=~]*\s*\d",
    r"\b\d+ (of|out of) \d+\b",
    r"\b\d+ (passed|failed|skipped)\b",
    r"~\s?\d",
    r"\b\d+(\.\d+)? (against|vs\.?|versus) \d",
    r"\btorch \d",
    r"\b(about|around|roughly) (a|an|one|two|half an?) (minute|second|hour)",
    r"\b(half|twice|double|triple|a third of) the (decode |prefill )?(speed|throughput|time)\b",
]


def test_readme_states_no_measured_figure_outside_the_report_block():
    """Every figure measured here lives in the block inferlab-report writes (from results.csv, with its hardware);
    the prose around it states mechanisms, defaults and sizes by construction, and points to the report."""
    from inferlab.report.build import README_END, README_START

    text = README.read_text()
    head, rest = text.split(README_START, 1)
    outside = head + rest.split(README_END, 1)[1]
    found = [
        (m.group(0), line.strip()[:100])
        for line in outside.splitlines()
        for pattern in MEASURED
        for m in re.finditer(pattern, line)
    ]
    assert found == []


@pytest.mark.slow
def test_the_committed_report_and_readme_block_regenerate_from_the_committed_csv(tmp_path: Path):
    """What a fresh clone's `inferlab-report` writes from the committed CSV alone is the committed report (but for
    its count of rows read back) and the README's block: every figure in either is a value of results.csv."""
    from inferlab.report.build import README_END, README_START, embed_headline

    (tmp_path / "outputs" / "report").mkdir(parents=True)
    (tmp_path / "outputs" / "report" / "results.csv").write_bytes(COMMITTED_CSV.read_bytes())
    report_file = build(tmp_path / "outputs", tmp_path / "outputs" / "report", tmp_path / REPORT.name)
    regenerated, committed = (f.read_text().split("\n\n", 2)[2] for f in (report_file, REPORT))  # after the header
    assert regenerated == committed, "rerun inferlab-report after changing a study's report config"
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text())
    embed_headline(readme, report_file, list(OmegaConf.load(CONF / "report.yaml").headline))
    block = README.read_text().split(README_START, 1)[1].split(README_END, 1)[0]
    assert readme.read_text().split(README_START, 1)[1].split(README_END, 1)[0] == block


def test_every_study_has_a_chart():
    from inferlab.report.build import study_specs

    assert [spec["name"] for spec in study_specs() if "chart" not in spec["report"]] == []


def test_notebook_charts_every_study_of_the_committed_csv_on_a_fresh_clone(tmp_path: Path, monkeypatch):
    """The notebook draws each study's chart with report/plots.py, as the report does, from the committed rows."""
    outputs = tmp_path / "outputs"  # what a fresh clone has: no result.json, only the report's CSV
    (outputs / "report").mkdir(parents=True)
    (outputs / "report" / "results.csv").write_bytes(COMMITTED_CSV.read_bytes())
    images = notebook_images(outputs, monkeypatch, timeout=300)
    studies = pd.read_csv(COMMITTED_CSV).query("status == 'ok'").study.nunique()
    assert len(images) == studies
    assert all(len(base64.b64decode(image["data"]["image/png"])) > 10_000 for image in images)


def test_a_study_shows_its_further_tables_for_the_rows_that_have_their_values(tmp_path: Path):
    root = tmp_path / "outputs"
    profile = {"steps_per_s": 12.5, "step_ms": 80.0, "forward_ms": 70.0}
    rows = [
        {"server": "inferlab", "concurrency": 1, "output_throughput": 90.0, **profile},
        {"server": "llama.cpp", "concurrency": 1, "output_throughput": 40.0},
    ]
    write(root, "serving/0", "serving", [], rows)
    report_file = tmp_path / "REPORT.md"
    build(root, tmp_path / "outputs" / "report", report_file)
    serving = report_file.read_text().split("## Serving under concurrency")[1].split("\n## ")[0]
    main, profile_table = serving.split("Targets, checked")[0].split("Where inferlab-serve's time went")
    assert "| llama.cpp | 40 " in main and "| inferlab  | 90 " in main
    assert "| 12.5 " in profile_table and "| 80 " in profile_table and "llama.cpp" not in profile_table


def test_rows_of_two_kinds_in_one_study_each_show_in_their_own_table(tmp_path: Path):
    root = tmp_path / "outputs"
    memory = {"kv_dtype": "int8", "request_tokens": 64, "held_mb": 0.75, "requests_in_pool": 342}
    agreement = {"precision": "int4", "kv_reference": "bfloat16", "positions": 384, "top1_agreement_pct": 97.4}
    write(root, "kv_memory/0", "kv_memory", ["cache=paged_int8"], [memory, {**agreement, "mean_kl": 0.0123}])
    report_file = tmp_path / "REPORT.md"
    build(root, tmp_path / "outputs" / "report", report_file)
    section = report_file.read_text().split("## KV memory per request")[1].split("\n## ")[0]
    main, more = section.split("What int8 KV costs")
    assert [line.split("|")[2].strip() for line in main.splitlines() if line.startswith("| paged_int8")] == ["64"]
    assert "| int4 " in more and "| 97.4 " in more and "| 0.0123 " in more and "342" not in more


def test_targets_say_which_are_met_and_by_how_much_the_others_are_missed():
    rows = pd.DataFrame(
        [
            {"server": "inferlab", "isa": "avx2", "concurrency": 8.0, "tok_s": 300.0, "ttft_ms": 20.0},
            {"server": "inferlab", "isa": "avx512", "concurrency": 8.0, "tok_s": 450.0, "ttft_ms": 30.0},
            {"server": "vllm", "isa": None, "concurrency": 8.0, "tok_s": 200.0, "ttft_ms": 50.0},
        ]
    )
    where = {"server": "inferlab", "concurrency": 8}
    targets = [
        {"name": "fastest build vs vllm", "value": "tok_s", "where": where, "over": {"server": "vllm"}, "pick": "max",
         "at_least": 1.5},
        {"name": "median build vs vllm", "value": "tok_s", "where": where, "over": {"server": "vllm"}, "at_least": 2},
        {"name": "ttft", "value": "ttft_ms", "where": where, "at_most": 20},
        {"name": "a level not run", "value": "tok_s", "where": {"server": "inferlab", "concurrency": 32}, "at_least": 1},
        {"name": "a column not there", "value": "tpot_ms", "where": where, "at_most": 1},
    ]  # fmt: skip
    table = target_table(rows, targets)
    assert list(table.columns) == ["target", "measured", "goal", "verdict"]
    assert table.measured.iloc[:3].tolist() == [2.25, 1.875, 25.0] and table.measured.iloc[3:].isna().all()
    assert table.goal.tolist() == [">= 1.5", ">= 2", "<= 20", ">= 1", "<= 1"]
    assert table.verdict.tolist() == [
        "met",
        "missed: 0.94x the goal",
        "missed: 1.25x the goal",
        "not measured here",
        "not measured here",
    ]
    # a miss quotes the value of another study's rows that explains it, where that study has it
    profile = pd.DataFrame(
        [
            {"study": "profile", "precision": "int4", "sequences": 16, "speedup_ceiling": 3.5},
            {"study": "profile", "precision": "int8", "sequences": 16, "speedup_ceiling": 5.0},
            {"study": "serving", "precision": None, "sequences": None, "speedup_ceiling": None},
        ]
    )
    why = {"study": "profile", "value": "speedup_ceiling", "where": {"precision": "int4", "sequences": 16}, "says": "x"}
    other = {**why, "where": {"precision": "int8", "sequences": 16}, "says": "y"}
    explained = [{**t, "why": [why, other]} for t in targets]
    assert target_table(rows, explained, profile).verdict.tolist()[:3] == [
        "met",
        "missed: 0.94x the goal; x: 3.5 (profile); y: 5 (profile)",
        "missed: 1.25x the goal; x: 3.5 (profile); y: 5 (profile)",
    ]
    unexplained = {**why, "where": {"precision": "fp32", "sequences": 16}}
    assert target_table(rows, [{**targets[1], "why": [unexplained, other]}], profile).verdict[0] == (
        "missed: 0.94x the goal; y: 5 (profile)"
    )
