"""The pre-registered study's machinery (study/study.py, `reproduce.py --study`): the world without
a written signal, the rows it ran on, --toy-world, the mechanism's readouts on hand-made samples, the verdict
rule on hand-made per-seed numbers (one case per outcome), and a tiny end-to-end run."""
import hashlib
import json
import random

import pytest

import toy

QUIET = toy.WORLDS["legible-quiet"]


def test_the_worlds_rows_are_as_they_were():
    """Pinned at 4b29540, when the world was built beside the earlier `sum` one: every number measured on
    it (docs/toy-world.md, the study) was measured on these rows."""
    pins = {"test/toy": "9e0346a90e5f4ee4", "test/toy-long": "bcaa527dad38f641", "test/toy-sub": "bc56499a9e264c05",
            "train/toy": "124cda8e60380e7a", "train/toy-long": "66d69562f825171d", "train/toy-sub": "78c21b5aa1638f93"}
    for where, pin in pins.items():
        split, name = where.split("/")
        rows = toy.dataset(split, name)
        assert hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] == pin, where


def test_the_quiet_world_writes_the_legible_traces_without_a_flag():
    """Same slips, same counts, never a `?`: the flag's draw is still made (at p 0), so a quiet trace is
    the world's with its flags removed, and the two warm starts differ in the `?` alone."""
    flagless = lambda world: {k: v for k, v in world.items() if k not in ("p_flag_wrong", "p_flag_right")}  # noqa: E731
    assert flagless(QUIET) == flagless(toy.WARM) and toy.WORLDS[toy.WORLD] is toy.WARM
    assert (QUIET["p_flag_wrong"], QUIET["p_flag_right"]) == (0.0, 0.0)
    rng, flags = random.Random(3), 0
    for _ in range(2000):
        terms = [rng.randint(1, 9) for _ in range(rng.randint(4, 8))]
        seed = rng.random()
        loud, _ = toy.trace(terms, random.Random(seed))
        quiet, _ = toy.trace(terms, random.Random(seed), QUIET)
        flags += sum("?" in line for line in loud)
        assert quiet == [line.replace("?", "") for line in loud]
    assert flags > 100
    tok, rng = toy.tokenizer(), random.Random(0)
    rows = toy.dataset("train", "toy")
    for i in range(300):   # the warm start's sequences, forced ones included
        ids, _ = toy.example(tok, rows[i]["problem"], rng, i % 2 == 0, QUIET)
        assert "?" not in tok.decode(ids)


def test_the_toy_names_read_the_worlds_rows_and_toy_world_marks_a_model_folder_as_toy(tmp_path):
    """The toy benchmark names read the world's rows (train.py's --data / --eval-data, evaluate.py's
    benchmarks and toy post-hoc fits); --toy-world given with a --model folder applies the toy world's
    defaults; a run keeps its world on resume and refuses another."""
    import data
    from evaluation import benchmarks, probes
    import config
    from harness.files import UserError
    rows = {split: toy.dataset(split, "toy") for split in ("train", "test")}
    assert data.load_rows("toy", split="test") == rows["test"]
    [(name, got, _, _)] = benchmarks.load_benchmarks(["toy"], limit=3)
    assert (name, got) == ("toy", rows["test"][:3])
    assert probes.toy_fit_rows("toy") == rows["train"]
    assert probes.toy_fit_rows("toy-pooled")[:3] == [toy.dataset("train", b)[0] for b in data.TOY_BENCHMARKS]

    cfg = config.resolve_args(["--model", toy.BASE_DIR, "--toy-world", "legible-quiet", "--out", str(tmp_path / "a")])
    assert (cfg["toy_world"], cfg["data"], cfg["max_new_tokens"], cfg["lr"], cfg["lam"]) == \
        ("legible-quiet", "toy", 72, 2e-5, 1.0)
    assert config.resolve_args(["--model", toy.BASE_DIR, "--out", str(tmp_path / "b")])["data"] == "deepscaler"
    assert config.resolve_args(["--out", str(tmp_path / "c")])["toy_world"] is None   # --model toy: the world's
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(dict(model=toy.BASE_DIR, toy_world="legible", seed=0)))
    assert config.resolve_args(["--resume", str(run)])["max_new_tokens"] == 72   # the toy world's, from the saved world
    with pytest.raises(UserError, match="--toy-world cannot change on resume"):
        config.resolve_args(["--resume", str(run), "--toy-world", "legible-quiet"])


def test_the_readouts_count_flags_after_wrong_and_right_lines_and_rank_the_unflagged():
    from study import mechanism, premises
    assert premises.parse is mechanism.parse   # one reader of the lines, shared
    sample = lambda bench, problem, text, correct, conf: dict(  # noqa: E731
        benchmark=bench, problem=problem, text=text + "</think>\\boxed{0}", correct=correct, confidence=conf)
    rows = [sample("toy", "3+5+7+2", "3+5=8\n8+7=14?\n14+2=16\n", 0, 0.2),   # a slip, flagged
            sample("toy", "3+5+7+2", "3+5=8\n8+7=15\n15+2=17\n", 1, 0.9),
            sample("toy", "3+5+7+2", "3+5=8\n8+7=16\n16+2=18\n", 0, 0.4),    # a slip, not flagged
            sample("toy", "3+5+7+2", "3+5=8?\n8+7=15\n15+2=17\n", 1, 0.3),   # a right line flagged
            sample("toy-long", "9+9", "9+9=18\n", 1, 0.7)]
    got = mechanism.readouts(rows)
    assert got["toy"] == dict(flag_wrong=0.5, wrong_lines=2, flag_right=0.1, right_lines=10,
                              auroc_unflagged=1.0, unflagged=2)   # 0.9 (right) above 0.4 (wrong); 0.2, 0.3 flagged
    assert got["toy-long"] == dict(flag_wrong=None, wrong_lines=0, flag_right=0.0, right_lines=1,
                                   auroc_unflagged=None, unflagged=1)   # one class: no AUROC
    assert got["Overall"] == dict(flag_wrong=0.5, flag_right=0.05, auroc_unflagged=1.0)
    # ranked the other way round, the unflagged AUROC says so
    rows[1]["confidence"] = 0.1
    assert mechanism.readouts(rows)["toy"]["auroc_unflagged"] == 0.0


# The verdict on hand-made numbers: GRPO's Overall is a constant, each variant's is GRPO's plus an effect
# plus a seed pattern that sums to 0 over the 8 seeds, so each paired mean is the effect exactly and its
# interval is +-0.0060 around it.
PATTERN = (1.0, -1.0, 0.5, -0.5, 0.8, -0.8, 0.2, -0.2)
GRPO = dict(acc=0.80, ece=0.10, pce=0.08, brier=0.15, auroc=0.70, flag_wrong=0.50, flag_right=0.05,
            auroc_unflagged=0.60)
GAINS = dict(auroc=0.05, ece=-0.04, pce=-0.04, flag_wrong=0.10, auroc_unflagged=0.02)


def _per(effects, signal=0.30, calib=0.20):
    """per[variant][seed] as study.write_study builds it (Overall only); effects {variant: {key: x}}."""
    from study import study
    per = {}
    for i, v in enumerate(["grpo", *effects]):
        for seed in range(8):
            jitter = 0.0 if v == "grpo" else 0.01 * PATTERN[(seed + i) % 8]
            x = {k: base + effects.get(v, {}).get(k, 0.0) + jitter for k, base in GRPO.items()}
            per.setdefault(v, {})[seed] = {
                study.MATCHED: dict(Overall={k: x[k] for _, k in study.COLUMNS}),
                study.RELEASED: dict(Overall={k: x[k] for _, k in study.COLUMNS}),
                "readouts": dict(Overall={k: x[k] for _, k in study.READOUTS}),
                "train": dict(signal_frac=signal, calib_share=calib, heldout_start=0.6, heldout_end=0.9)}
    return per


def _verdict(effects, **train):
    from study import study
    per = _per(effects, **train)
    diffs = study.differences(per)
    result = study.verdict(per, diffs)
    return result, {c["text"].split(" (")[0]: c["holds"] for c in result["criteria"]}, study.report(per, diffs, result)


def test_the_verdict_is_for_when_every_for_criterion_holds():
    effects = {"rlcm-0.3": dict(auroc=0.02, ece=-0.01, pce=-0.01), "rlcm-1": GAINS,
               "rlcm-3": dict(GAINS, auroc=0.08, ece=-0.06, acc=-0.01), "rlcm-shuffled": {}, "rlcm-quiet": {}}
    result, holds, md = _verdict(effects)
    assert result["outcome"] == "for", result["line"]
    assert [c["holds"] for c in result["criteria"]] == [True] * 6 + [False] * 3
    assert "**Verdict (for).** For the paper's direction" in md
    assert "| for | Overall AUROC >= +0.03, interval excluding 0 | +0.050 [+0.044, +0.056] | yes |" in md
    assert "AUROC +0.020 / +0.050 / +0.080; ECE -0.010 / -0.040 / -0.060 | yes |" in md
    assert "| RLCM lam 1 - GRPO | Overall | +0.000 [-0.006, +0.006] | -0.040 [-0.046, -0.034] |" in md
    assert "| RLCM lam 1, no `?` - GRPO, no `?` |" not in md   # no quiet GRPO: no quiet pair
    # a gain just under the threshold, or an interval touching 0, is not one
    assert _verdict(dict(effects, **{"rlcm-1": dict(GAINS, auroc=0.029)}))[0]["outcome"] == "inconclusive"


def test_the_verdict_is_against_when_nothing_moves_although_the_margin_had_room():
    effects = dict.fromkeys(("rlcm-0.3", "rlcm-1", "rlcm-3", "rlcm-shuffled"), {})
    result, holds, _ = _verdict(effects)
    assert result["outcome"] == "against" and holds["intervals holding 0 while premise"]
    assert result["line"].startswith("Against the paper's direction: intervals holding 0 while premise (iii) holds")
    # the same nothing where the margin had no room (premise (iii) fails) decides nothing
    result, holds, _ = _verdict(effects, calib=0.05)
    assert result["outcome"] == "inconclusive" and not any(c["holds"] for c in result["criteria"] if c["side"] == "against")
    assert "For fails on: Overall AUROC >= +0.03" in result["line"]
    # gains bought with accuracy
    lossy = dict(effects, **{"rlcm-1": dict(GAINS, acc=-0.05)})
    assert _verdict(lossy)[0]["outcome"] == "against" and _verdict(lossy)[1]["gains only with an accuracy loss"]


def test_the_verdict_is_inconclusive_when_the_gain_does_not_grow_with_lam():
    effects = {"rlcm-0.3": dict(GAINS, auroc=0.06), "rlcm-1": GAINS, "rlcm-3": dict(GAINS, auroc=0.08),
               "rlcm-shuffled": {}}
    result, holds, _ = _verdict(effects)
    assert result["outcome"] == "inconclusive"
    assert [k for k, v in holds.items() if not v and k.startswith(("growing", "Overall", "the mech", "no eff"))] == \
        ["growing with lam"]
    assert result["line"] == ("Inconclusive: no Against criterion holds, and For fails on: growing with lam (lam 0.3 "
                              "/ 1 / 3: AUROC not falling, ECE not rising).")


def test_the_verdict_is_against_when_shuffled_labels_do_as_well():
    effects = {"rlcm-0.3": dict(auroc=0.02, ece=-0.01, pce=-0.01), "rlcm-1": GAINS, "rlcm-3": dict(GAINS, auroc=0.08),
               "rlcm-shuffled": dict(GAINS, auroc=0.06)}
    result, holds, _ = _verdict(effects)
    assert result["outcome"] == "against" and holds["the shuffled control doing as well"]
    assert not holds["no effect in the shuffled control"]
    assert "the shuffled control doing as well" in result["line"]
    # a shuffled control with a smaller effect than RLCM's is neither "no effect" nor "as well": inconclusive
    assert _verdict(dict(effects, **{"rlcm-shuffled": dict(GAINS, auroc=0.02)}))[0]["outcome"] == "inconclusive"


@pytest.mark.parametrize("flags, says", [
    (["--study"], "--study needs --base DIR"),
    (["--study", "--base", toy.BASE_DIR], "--study needs --quiet-base DIR"),
    (["--study", "--methods", "grpo", "--base", "nowhere"], "--base nowhere: no model there"),
    (["--base", toy.BASE_DIR], "--base is for --study"),
    (["--study", "--ablations"], "--ablations is for the paper's table"),
    (["--study", "--methods", "grpo,rlcm"], "unknown method 'rlcm'"),
    (["--study", "--methods", "rlcm-1", "--base", toy.BASE_DIR, "--train-args", "--lam 2"], "--lam is reproduce.py's"),
    (["--study", "--methods", "rlcm-1", "--base", toy.BASE_DIR, "--eval-args", "--probe-data toy"], "--probe-data is")])
def test_bad_study_flags_exit_2_with_one_line_and_create_nothing(tmp_path, capsys, flags, says):
    import reproduce
    out = tmp_path / "study"
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--out", str(out), *flags])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert not out.exists()


def test_the_study_runs_each_variant_from_its_base_with_both_fits(tmp_path):
    import reproduce
    from study import study
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    (quiet / "config.json").write_text("{}")
    args, methods, seeds, _ = reproduce.parse_args(["--study", "--base", toy.BASE_DIR, "--quiet-base", str(quiet),
                                                    "--out", str(tmp_path / "s")])
    assert methods == tuple(study.VARIANTS) and seeds["rlcm-quiet"] == list(range(8)) and args.world == "legible"
    work = {j["name"]: j for j in reproduce.job_list(args, methods, seeds)}
    assert len(work) == 7 * 8 and list(work)[:2] == ["grpo seed 0", "rlcm-0.3 seed 0"]
    flags = lambda words: dict(zip(words[::2], words[1::2]))  # noqa: E731
    train = flags(work["rlcm-shuffled seed 3"]["train"])
    assert (train["--reward"], train["--lam"], train["--probe-labels"], train["--seed"]) == ("rlcm", "1", "shuffled", "3")
    assert (train["--model"], train["--toy-world"], train["--max-new-tokens"]) == (toy.BASE_DIR, "legible", "72")
    assert flags(work["rlcm-quiet seed 0"]["train"])["--model"] == str(quiet)
    assert flags(work["grpo-quiet seed 0"]["train"])["--model"] == str(quiet)
    assert "--lam" not in work["grpo seed 0"]["train"] and "--probe-labels" not in work["rlcm-3 seed 0"]["train"]
    evals = work["rlcm-1 seed 0"]["evals"]
    assert [(e["folder"], e["cmd"][e["cmd"].index("--probe-data") + 1]) for e in evals] == \
        [("eval", "toy-pooled"), ("eval-released", "toy")]
    assert all("--no-early-exit" in e["cmd"] and e["cmd"][-4:] == ["--probe-questions", "80", "--toy-world", "legible"]
               for e in evals)   # both fits at the size the study ran with, whatever toy-pooled's default
    assert study.cost_estimate([(45, 128, 72)] * 56, [(6000, 640)] * 112, jobs=2, cores=2) == \
        (pytest.approx(56 * 170 + 112 * 280), pytest.approx(40880 / 2))


TRAIN = ("--steps 2 --prompts-per-step 4 --group-size 4 --max-new-tokens 40 --eval-n 8 --eval-every 0 "
         "--log-samples 0 --eval-probe-n 0")
EVAL = "--limit 4 --n-samples 1 --max-new-tokens 64 --probe-questions 4 --probe-samples 2 --posthoc-budgets 2"


@pytest.mark.slow   # four trainings and eight evaluations
def test_a_tiny_study_writes_its_table_and_verdict_and_a_rerun_redoes_nothing(tmp_path, capsys):
    import os
    import reproduce
    out = str(tmp_path / "study")
    argv = ["--study", "--base", toy.BASE_DIR, "--quiet-base", toy.BASE_DIR, "--methods",
            "grpo,rlcm-shuffled", "--seeds", "0,1", "--out", out, "--train-args", TRAIN, "--eval-args", EVAL]
    reproduce.main(argv)
    printed = capsys.readouterr().out
    assert printed.startswith("study: 4 of 4 trainings and 8 of 8 evaluations to do: about ") and "[12/12]" in printed
    assert "rlcm-shuffled seed 1: evaluated in" in printed and "(toy-pooled fit)" in printed
    cfg = json.load(open(os.path.join(out, "runs", "rlcm-shuffled-seed0", "config.json")))
    assert (cfg["reward"], cfg["lam"], cfg["probe_labels"], cfg["toy_world"], cfg["model"], cfg["steps"]) == \
        ("rlcm", 1.0, "shuffled", toy.WORLD, toy.BASE_DIR, 2)
    for folder, fit in (("eval", "toy-pooled"), ("eval-released", "toy")):
        [entry] = json.load(open(os.path.join(out, folder, "grpo-seed1", "results.json"))).values()
        assert entry["posthoc_probe"]["data"] == fit and entry["settings"]["toy"]["toy_world"] == toy.WORLD
    rows = [json.loads(line) for line in open(os.path.join(out, "eval", "grpo-seed1", "samples.jsonl"))]
    assert len(rows) == 12 and all(r["text"] and r["problem"] for r in rows)

    res = json.load(open(os.path.join(out, "results.json")))
    assert sorted(res["study"]) == ["grpo", "rlcm-shuffled"] and sorted(res["study"]["grpo"]) == ["0", "1"]
    seed = res["study"]["grpo"]["1"]
    entry = json.load(open(os.path.join(out, "eval", "grpo-seed1", "results.json")))["grpo-seed1/step_000002"]
    assert seed["eval"]["toy"]["ece"] == entry["benchmarks"]["toy"]["ece"]
    assert 0 <= seed["readouts"]["Overall"]["flag_right"] <= 1 and seed["readouts"]["toy"]["right_lines"] > 0
    assert seed["train"]["heldout_start"] is not None
    assert res["differences"]["rlcm-shuffled"]["matched"]["Overall"]["ece"]["n"] == 2
    assert res["verdict"]["outcome"] == "inconclusive"   # no RLCM lam 1 here: For fails on missing numbers
    table = open(os.path.join(out, "table.md")).read()
    assert "| RLCM lam 1, shuffled-label probe - GRPO | Overall |" in table and "**Verdict (inconclusive).**" in table

    def mtimes():
        return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns
                for sub in ("runs", "eval", "eval-released", "logs") for d, _, ns in os.walk(os.path.join(out, sub))
                for n in ns}
    before = mtimes()
    reproduce.main(argv)
    printed = capsys.readouterr().out
    assert printed.startswith("study: 0 of 4 trainings and 0 of 8 evaluations to do")
    assert printed.count("recorded already") == 4 and "[12/12]" in printed and mtimes() == before
    assert json.load(open(os.path.join(out, "results.json")))["study"] == res["study"]
    # the records alone, copied to another folder (another machine), stand for the jobs: nothing runs again,
    # and the table is the same; a record made with other settings is not taken for the job
    import shutil
    other = str(tmp_path / "other")
    shutil.copytree(os.path.join(out, "records"), os.path.join(other, "records"))
    rec = json.load(open(os.path.join(other, "records", "grpo-seed0.json")))
    assert rec["made_with"]["train"][:6] == ["--reward", "grpo", "--seed", "0", "--out", "--model"]   # no paths
    assert str(tmp_path) not in json.dumps(rec) and rec["git_commit"] and len(rec["model"]) == 16
    assert rec["numbers"]["eval"]["toy"]["ece"] == res["study"]["grpo"]["0"]["eval"]["toy"]["ece"]
    moved = [*argv[:argv.index("--out")], "--out", other, *argv[argv.index("--out") + 2:]]
    reproduce.main(moved)
    printed = capsys.readouterr().out
    assert printed.startswith("study: 0 of 4 trainings and 0 of 8 evaluations to do")
    assert not os.path.exists(os.path.join(other, "runs"))
    assert open(os.path.join(other, "table.md")).read().split("\n")[2:] == table.split("\n")[2:]
    from study import study
    for extra, taken in (([], True), (["--eval-args", EVAL + " --limit 3"], False), (["--train-args", TRAIN + " --lr 1e-5"], False)):
        args, methods, seeds, _ = reproduce.parse_args([*moved, *extra])
        job = reproduce.job_list(args, methods, seeds)[0]
        assert (study.read_record(args, job) is not None) == taken
    # another world into the same folder: its runs are refused, not mixed
    with pytest.raises(SystemExit) as e:
        reproduce.main([*argv, "--world", "legible-quiet"])
    assert e.value.code == 2 and "was trained with other settings: --toy-world legible (this command: legible-quiet)" in \
        capsys.readouterr().err


def test_the_readme_and_the_docs_hold_what_the_committed_records_print(tmp_path):
    """docs/reproduce/study/records/ holds the study's 56 records (study/study.py); given them,
    study.write_study runs nothing and writes the table that docs/reproduce/study/table.md holds and
    whose Overall differences, readouts and verdict the README quotes."""
    import os
    import shutil
    import reproduce
    from study import study
    committed = os.path.join(reproduce.ROOT, "docs", "reproduce", "study")
    shutil.copytree(os.path.join(committed, "records"), tmp_path / "records")
    args, methods, seeds, _ = reproduce.parse_args(["--study", "--base", toy.BASE_DIR, "--quiet-base",
                                                    os.path.join(reproduce.ROOT, "toy_base_quiet"), "--out", str(tmp_path)])
    work = reproduce.job_list(args, methods, seeds)
    text = study.write_study(args, work, [])
    assert len(os.listdir(tmp_path / "records")) == len(work) == 56
    with open(os.path.join(committed, "table.md"), encoding="utf-8") as f:
        assert f.read().split("\n")[1:] == text.split("\n")[1:]   # the first line: when and with what command
    with open(tmp_path / "results.json", encoding="utf-8") as f:
        res = json.load(f)
    with open(os.path.join(reproduce.ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for v, ref in study.REFERENCE.items():
        m, r = res["differences"][v]["matched"]["Overall"], res["differences"][v]["readouts"]["Overall"]
        row = f"| {study.VARIANTS[v]['label']} - {study.VARIANTS[ref]['label']} | " + " | ".join(
            study._shown(x) for x in (m["acc"], m["ece"], m["pce"], m["auroc"], r["flag_wrong"])) + " |"
        assert row in readme
    assert f"**Verdict: {res['verdict']['outcome']}" in readme


def test_the_study_stands_above_evaluation_and_nothing_below_imports_it():
    """study/ and reproduce.py may use evaluation/, harness/ and the method; none of those uses them."""
    from test_imports import project_imports
    edges = project_imports()
    assert {"study.study", "study.comparison", "study.stats"} <= set(edges) and "evaluation.report" in edges["study.study"]
    above = lambda name: name.startswith("study.") or name == "reproduce"  # noqa: E731
    assert [(m, n) for m, names in edges.items() if not above(m) for n in names if above(n)] == []
