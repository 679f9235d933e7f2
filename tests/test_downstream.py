"""``nobubble eval``: score files that are never replaced, lm-eval's results read right, scores in
``nobubble report``, and (slow) the whole path on a trained run checked against log-likelihoods
computed directly with transformers, offline."""

import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nobubble.cli import build_parser, main
from nobubble.downstream import harness
from nobubble.json_files import DamagedFile
from nobubble.runfolder.scores import Column, latest_scores, write_scores
from tests.helpers.runs import make_run

TASKS = Path(__file__).parent / "data" / "lm_eval_tasks"
TASK = "nobubble_tiny_qa"
SHAPE = [
    *("d_model=64", "n_layers=2", "n_heads=4", "n_kv_heads=2", "d_ff=128"),
    *("seq_len=32", "batch_size=4", "eval_batches=1", "threads=1", "steps=3"),
]


def record(step: int, acc: float, task: str = TASK, limit: int | None = None) -> dict:
    """A score file as `nobubble eval` writes it, with one task and two metrics."""
    results = {
        "alias": task,
        "n_shot": 0,
        "samples": 24,
        "metrics": {
            "acc": {"value": acc, "stderr": 0.1},
            "acc_norm": {"value": acc / 2, "stderr": None},
        },
    }
    return {
        "format": 1,
        "step": step,
        "version": step,
        "tasks": [task],
        "headline": [task],
        "results": {task: results},
        "settings": {"limit": limit},
    }


def test_score_files_are_added_never_replaced_and_the_newest_checkpoint_wins(tmp_path):
    paths = [
        write_scores(tmp_path, record(300, 0.25)),
        write_scores(tmp_path, record(300, 0.50)),  # the same checkpoint again
        write_scores(tmp_path, record(100, 0.75)),  # an older checkpoint, evaluated later
        write_scores(tmp_path, record(300, 0.40, limit=5)),
    ]
    names = [p.name for p in paths]
    assert names == ["step_000300.json", "step_000300-2.json", "step_000100.json", *names[3:]]
    assert names[3] == "step_000300-3.json"
    assert json.loads(paths[0].read_text())["results"][TASK]["metrics"]["acc"]["value"] == 0.25
    assert sorted(p.name for p in (tmp_path / "downstream").iterdir()) == sorted(names)

    scores = latest_scores(tmp_path)
    full = Column(TASK, "acc", 0, None)
    assert (scores[full].value, scores[full].step, scores[full].stderr) == (0.50, 300, 0.1)
    assert scores[Column(TASK, "acc_norm", 0, None)].stderr is None
    assert scores[Column(TASK, "acc", 0, 5)].value == 0.40  # a limit is its own column
    assert Column(TASK, "acc", 0, 5).label == f"{TASK} acc, first 5"
    assert latest_scores(tmp_path / "nowhere") == {}


def test_a_score_file_that_is_not_ours_is_named(tmp_path):
    (tmp_path / "downstream").mkdir()
    (tmp_path / "downstream" / "step_000001.json").write_text('{"step": 1}')
    with pytest.raises(DamagedFile, match=r"step_000001\.json is not a score file"):
        latest_scores(tmp_path)


# lm-eval's results for a group of two tasks, one with a filter, and a task outside the group.
RESULTS = {
    "results": {
        "grp": {"alias": "grp", "acc,none": 0.5, "acc_stderr,none": "N/A"},
        "grp_a": {"alias": " - a", "acc,none": 0.25, "acc_stderr,none": 0.05, "sample_len": 8},
        "grp_b": {"alias": " - b", "exact_match,strict-match": 1.0, "name": "grp_b"},
        "solo": {"alias": "solo", "acc,none": 0.75, "acc_norm,none": 0.5},
    },
    "group_subtasks": {"grp": ["grp_a", "grp_b"], "solo": []},
    "n-shot": {"grp_a": 5, "grp_b": 5, "solo": 0},
    "n-samples": {"grp_a": {"original": 10, "effective": 8}, "solo": {"effective": 3}},
    "versions": {"grp_a": 1.0},
}


def test_lm_eval_results_become_a_score_file():
    out = harness.score_record(
        RESULTS,
        step=7,
        version=6,
        tasks=["grp", "solo"],
        settings={"limit": 8},
        eval_s=1.23456,
        date="now",
    )
    assert out["headline"] == ["grp", "solo"]
    assert out["results"]["grp"] == {
        "alias": "grp",
        "n_shot": 5,  # its tasks agree
        "samples": None,
        "metrics": {"acc": {"value": 0.5, "stderr": None}},
    }
    assert out["results"]["grp_a"]["samples"] == 8
    assert out["results"]["grp_b"]["metrics"] == {
        "exact_match (strict-match)": {"value": 1.0, "stderr": None}
    }
    assert set(out["results"]["solo"]["metrics"]) == {"acc", "acc_norm"}
    assert (out["step"], out["version"], out["eval_s"]) == (7, 6, 1.235)
    assert out["versions"]["task_versions"] == {"grp_a": 1.0}
    assert out["versions"]["lm_eval"]  # installed with the eval extra


def test_an_unknown_task_name_is_named_with_a_guess_and_how_to_list_names():
    error = harness.unknown_tasks_error(["helaswag"], ["hellaswag", "arc_easy"])
    assert "'helaswag'" in str(error) and "did you mean 'hellaswag'" in str(error)
    assert "lm-eval ls tasks" in str(error)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", " , "], "names no task"),
        (["--tasks", TASK, "--include-path", "no/such/dir"], "is not a folder"),
    ],
)
def test_bad_task_arguments_get_one_clear_line(tmp_path, capsys, argv, message):
    run = make_run(tmp_path, 2.0, name_as="run")
    assert main(["eval", str(run), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "least"), [("--num-fewshot", 0), ("--limit", 1), ("--batch-size", 1)]
)
def test_eval_numbers_name_the_least_they_accept_and_accept_it(capsys, option, least):
    argv = ["eval", "run", "--tasks", TASK, option]
    dest = option[2:].replace("-", "_")
    assert getattr(build_parser().parse_args([*argv, str(least)]), dest) == least
    refusals = {
        str(least - 1): f"must be >= {least}, got {least - 1}",
        "1.5": "must be a whole number, got '1.5'",
    }
    for wrong, refusal in refusals.items():
        with pytest.raises(SystemExit):
            build_parser().parse_args([*argv, wrong])
        assert capsys.readouterr().err == f"nobubble eval: error: argument {option}: {refusal}\n"


def test_eval_refuses_a_folder_that_is_no_run(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--tasks", TASK]) == 2
    assert "is not a nobubble run folder" in capsys.readouterr().err


def test_eval_refuses_a_run_folder_that_cannot_take_its_scores_before_evaluating(
    tmp_path, capsys, lock_writes, monkeypatch
):
    """A run folder that takes no files (``lock_writes``: see conftest for how read-only is
    simulated), or whose downstream/ is a file: one line, before lm-eval is even looked for."""

    def looked_for() -> None:
        raise AssertionError("lm-eval was looked for")

    monkeypatch.setattr(harness, "require_lm_eval", looked_for)
    taken = make_run(tmp_path, 2.0, name_as="taken")
    (taken / "downstream").write_text("mine")
    locked = lock_writes(make_run(tmp_path, 2.0, name_as="locked"))
    for run, problem in ((taken, "is not a folder"), (locked, f"cannot write in {locked}")):
        assert main(["eval", str(run), "--tasks", TASK]) == 2
        err = capsys.readouterr().err
        assert f"RUN_FOLDER {run / 'downstream'}: " in err and problem in err, err
        assert err.count("\n") == 1
    assert (taken / "downstream").read_text() == "mine"
    assert not (locked / "downstream").exists()


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("|")[1:-1]]


def test_report_puts_scores_beside_losses_and_leaves_other_reports_alone(tmp_path, capsys):
    runs = tmp_path / "runs"
    evaluated = [make_run(runs, loss, seed=seed) for seed, loss in enumerate((2.0, 2.2))]
    make_run(runs, 2.5, schedule="2bw")
    out = tmp_path / "before"
    assert main(["report", str(runs), "--out", str(out)]) == 0
    before = (out / "report.md").read_text()
    assert "Downstream" not in before and "Downstream" not in capsys.readouterr().out

    for run, acc in zip(evaluated, (0.25, 0.5), strict=True):
        write_scores(run, record(100, acc))
    write_scores(evaluated[0], record(100, 0.75, task="other"))
    assert main(["report", str(runs), "--out", str(tmp_path / "after")]) == 0
    after = (tmp_path / "after" / "report.md").read_text()
    start = after.index("## Downstream evaluation")
    end = after.index("\n## ", start) + 1
    assert after[:start] + after[end:] == before
    table = [cells(line) for line in after[start:end].split("\n\n")[1].splitlines()]
    assert table[0][4:] == [
        "eval step",
        f"{TASK} acc",
        f"{TASK} acc_norm",
        "other acc",
        "other acc_norm",
    ]
    sync = table[2]
    assert sync[:5] == ["adamw", "sync", "2", "2.1000 ± 0.1414", "100"]
    assert sync[5] == f"0.3750 ± {statistics.stdev([0.25, 0.5]):.4f}"
    assert sync[6] == f"0.1875 ± {statistics.stdev([0.125, 0.25]):.4f}"
    assert sync[7] == "0.7500 (se 0.1000) (1/2 seeds)"
    assert sync[8] == "0.3750 (1/2 seeds)"
    delayed = table[3]
    assert delayed[1] == "2bw" and delayed[4:] == ["—"] * 5
    assert "| other acc |" in capsys.readouterr().out


# ---- the whole path: train, `nobubble eval` offline, check against transformers ----

# Runs `nobubble eval` with every socket connection refused and recorded, so that any attempt to
# reach a hub (or anything else) fails the test even if a library swallows the error. It also
# counts torch's environment reports, which lm-eval would add to its results (~4 s each).
EVAL_SCRIPT = textwrap.dedent(
    """
    import json, socket, sys
    import torch.utils.collect_env
    attempts = []
    def refuse(self, address):
        attempts.append(repr(address))
        raise OSError("network access in an offline test")
    socket.socket.connect = refuse
    env_reports = []
    torch.utils.collect_env.get_pretty_env_info = lambda: env_reports.append(1) or "report"
    from nobubble.cli import main
    codes = [main(argv) for argv in json.loads(sys.argv[1])]
    print(json.dumps({"codes": codes, "attempts": attempts, "env_reports": len(env_reports)}))
    """
)
# A task whose Hub dataset no cache holds (the offline test's HF_HOME is its own, empty).
UNCACHED_TASK = textwrap.dedent(
    """
    task: nobubble_uncached_qa
    dataset_path: nobubble-tests/never-downloaded
    output_type: multiple_choice
    test_split: test
    doc_to_text: "{{question}}"
    doc_to_choice: "{{choices}}"
    doc_to_target: answer
    metric_list:
      - metric: acc
        aggregation: mean
        higher_is_better: true
    """
)


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A tiny trained run, evaluated four times by `nobubble eval` in one offline process, in a
    folder that is no git repository: a misspelled task, the local task in full, its first 6
    questions, then a task whose dataset is not cached."""
    root = tmp_path_factory.mktemp("downstream")
    run = root / "run"
    assert main(["train", "--no-progress", "--out", str(run), *SHAPE]) == 0
    uncached = root / "uncached_tasks"
    uncached.mkdir()
    (uncached / "uncached.yaml").write_text(UNCACHED_TASK)
    common = ["eval", str(run), "--device", "cpu", "--include-path"]
    calls = [
        [*common, str(TASKS), "--tasks", f"{TASK},hellaswagg"],
        [*common, str(TASKS), "--tasks", TASK],
        [*common, str(TASKS), "--tasks", TASK, "--limit", "6", "--batch-size", "3"],
        [*common, str(uncached), "--tasks", "nobubble_uncached_qa"],
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(root / "hf_home"),  # no cache but this test's own
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", EVAL_SCRIPT, json.dumps(calls)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run, result


def choice_log_likelihoods(model_dir: Path, questions: list[dict]) -> list[list[float]]:
    """log P(" " + choice | "Question: ...\\nAnswer:") of every choice, straight from
    transformers: one unpadded sequence at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for question in questions:
        context = tokenizer(f"Question: {question['question']}\nAnswer:").input_ids
        lls = []
        for choice in question["choices"]:
            answer = tokenizer(f" {choice}").input_ids
            with torch.no_grad():
                logits = model(torch.tensor([context + answer])).logits[0].double()
            logp = logits.log_softmax(-1)[len(context) - 1 : -1]
            lls.append(float(logp[torch.arange(len(answer)), torch.tensor(answer)].sum()))
        out.append(lls)
    return out


def accuracy(questions: list[dict], lls: list[list[float]], norm: bool) -> float:
    """Share of questions whose most likely choice is the answer (per character if ``norm``)."""
    right = 0
    for question, scores in zip(questions, lls, strict=True):
        if norm:
            scores = [s / len(c) for s, c in zip(scores, question["choices"], strict=True)]
        right += scores.index(max(scores)) == question["answer"]
    return right / len(questions)


@pytest.mark.slow
def test_eval_scores_equal_an_independent_computation(evaluated_run, tmp_path):
    from nobubble.hf.export import export_hf

    run, result = evaluated_run
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"codes": [2, 0, 0, 2], "attempts": [], "env_reports": 0}
    assert "lm-eval has no task named 'hellaswagg'" in result.stderr
    assert "did you mean 'hellaswag'" in result.stderr and "lm-eval ls tasks" in result.stderr

    files = sorted((run / "downstream").iterdir())
    assert [f.name for f in files] == ["step_000003-2.json", "step_000003.json"]
    full, first6 = (json.loads(f.read_text()) for f in reversed(files))
    assert (full["step"], full["version"], full["tasks"], full["headline"]) == (
        3,
        3,
        [TASK],
        [TASK],
    )
    assert full["settings"]["limit"] is None and first6["settings"]["limit"] == 6
    assert full["versions"]["lm_eval"] == harness._installed("lm_eval")

    questions = [json.loads(line) for line in (TASKS / "questions.jsonl").read_text().splitlines()]
    lls = choice_log_likelihoods(export_hf(run, tmp_path / "hf"), questions)
    for scores, subset in ((full, questions), (first6, questions[:6])):
        result_ = scores["results"][TASK]
        assert (result_["n_shot"], result_["samples"]) == (0, len(subset))
        for metric, norm in (("acc", False), ("acc_norm", True)):
            expected = accuracy(subset, lls[: len(subset)], norm)
            got = result_["metrics"][metric]
            assert got["value"] == pytest.approx(expected, abs=1e-12), metric
            # lm-eval's standard error of a mean: sample standard deviation / sqrt(n)
            n = len(subset)
            se = math.sqrt(expected * (1 - expected) / (n - 1))
            assert got["stderr"] == pytest.approx(se, rel=1e-9)
    assert f"| {TASK} | 0 | acc | {full['results'][TASK]['metrics']['acc']['value']:.4f} |" in (
        result.stdout
    )


@pytest.mark.slow
def test_eval_offline_names_the_missing_dataset_in_one_line_and_says_how_to_get_it(evaluated_run):
    _, result = evaluated_run
    assert json.loads(result.stdout.strip().splitlines()[-1])["codes"][3] == 2
    line = next(x for x in result.stderr.splitlines() if x.startswith("nobubble: error: the data"))
    assert "nobubble_uncached_qa" in line  # the task whose data is missing
    assert "'nobubble-tests/never-downloaded'" in line  # the dataset, as the datasets library says
    assert "get_task_dict(['nobubble_uncached_qa'], TaskManager(include_path=" in line
    assert "HF_DATASETS_CACHE" in line and "HF_DATASETS_OFFLINE=1" in line
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_eval_describes_no_machine_it_does_not_need(evaluated_run):
    """lm-eval's `git describe` (outside a repository: "fatal: not a git repository") and its
    environment report (~4 s) are not run; the score file records its own versions."""
    _, result = evaluated_run
    assert "not a git repository" not in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["env_reports"] == 0


@pytest.mark.slow
def test_report_shows_the_evaluated_run(evaluated_run, tmp_path, capsys):
    run, _ = evaluated_run
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    header = text.split("## Downstream evaluation")[1].split("\n\n")[1].splitlines()[0]
    assert f"| {TASK} acc | {TASK} acc_norm | {TASK} acc, first 6 |" in header
