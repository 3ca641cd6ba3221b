"""The toy world's traces (docs/toy-world.md): slips where a step carries, noticed slips flagged with
`?`, forced answers that copy the path."""
import random
import re

import grade
import toy

W = toy.WARM


def test_a_clean_trace_writes_each_running_total():
    clean = dict(W, p_slip=0.0, p_slip_carry=0.0, p_flag_right=0.0)
    lines, totals = toy.trace([3, 5, 7, 2], random.Random(0), clean)
    assert lines == ["3+5=8\n", "8+7=15\n", "15+2=17\n"] and totals == [3, 8, 15, 17]
    lines, _ = toy.trace([9, -6, 7], random.Random(0), clean)
    assert lines == ["9-6=3\n", "3+7=10\n"]


def test_carries_and_borrows_cross_a_multiple_of_ten():
    assert toy.carries(8, 7) and toy.carries(12, -5) and toy.carries(5, 5)
    assert not toy.carries(3, 5) and not toy.carries(17, -5) and not toy.carries(10, -0)


def test_slips_follow_carries_and_flags_follow_slips_at_the_world_rates():
    rng, n = random.Random(1), {}
    for _ in range(4000):
        terms = [rng.randint(1, 9) for _ in range(5)]
        lines, totals = toy.trace(terms, rng, W)
        for i, line in enumerate(lines):
            wrong = totals[i + 1] != totals[i] + terms[i + 1]
            key = ("carry" if toy.carries(totals[i], terms[i + 1]) else "plain", wrong)
            n.setdefault(key, []).append(line.endswith("?\n"))
    rate = lambda kind: len(n[(kind, True)]) / (len(n[(kind, True)]) + len(n[(kind, False)]))
    assert abs(rate("carry") - W["p_slip_carry"]) < 0.02 and abs(rate("plain") - W["p_slip"]) < 0.02
    flags = lambda wrong: [f for (kind, w), fs in n.items() if w == wrong for f in fs]
    assert abs(sum(flags(True)) / len(flags(True)) - W["p_flag_wrong"]) < 0.03
    assert abs(sum(flags(False)) / len(flags(False)) - W["p_flag_right"]) < 0.01


def test_a_forced_answer_is_the_sum_the_path_implies_so_it_copies_the_path():
    terms, lines, totals = [3, 5, 7, 2], ["3+5=8\n", "8+7=14?\n", "14+2=16\n"], [3, 8, 14, 16]
    cuts = {3: "3+5+7+2", 6: "8+7+2", 13: "8+7+2", 14: "14+2", 21: "14+2", 22: "16"}
    assert {b: toy.implied_sum("3+5+7+2", terms, lines, totals, b) for b in cuts} == cuts
    # graded by value: the written total plus what is left, right or wrong
    assert {b: grade.integer_sum(v) or int(v) for b, v in cuts.items()} == {3: 17, 6: 17, 13: 17, 14: 16, 21: 16, 22: 16}
    assert toy.implied_sum("9-6+2-7", [9, -6, 2, -7], ["9-6=3\n"], [9, 3], 6) == "3+2-7"
    # a warm-start forced example ends in such a sum
    tok, rng = toy.tokenizer(), random.Random(0)
    for _ in range(20):
        ids, _ = toy.example(tok, "9-3+5-2+4", rng, True)
        answer = tok.decode(ids).rsplit("\\boxed{", 1)[1].split("}")[0]
        assert grade.integer_sum(answer) is not None or answer.isdigit()


def test_the_benchmarks_have_their_sizes():
    for name, ((lo, hi), _) in toy.BENCHMARKS.items():
        rows = toy.dataset("test", name)
        sizes = {len(toy.terms_of(r["problem"])) for r in rows}
        assert min(sizes) == lo and max(sizes) == hi and len(rows) == toy.N_TEST
    # the rows the study ran on are pinned by hash in tests/test_toy_benchmarks.py


def slipped(problem, text):
    """Whether a complete thinking line of `text` writes a wrong total, or leaves the trace of `problem`."""
    terms, total = toy.terms_of(problem), None
    for i, line in enumerate(text.split("</think>")[0].split("\n")[:-1]):   # the last piece is not whole
        m = re.match(r"^(\d+)([+-]\d+)=(\d+)\??$", line)
        if not m or i + 1 >= len(terms) or int(m[1]) != (terms[0] if total is None else total) or \
                int(m[2]) != terms[i + 1] or int(m[3]) != int(m[1]) + terms[i + 1]:
            return True
        total = int(m[3])
    return False


def test_posthoc_labels_inside_the_thinking_copy_the_path_on_the_warm_start(tmp_path, monkeypatch):
    """evaluate.py's post-hoc fit on the toy (the protocol get_probe builds): at budgets inside the
    thinking and before any wrong total, the warm start's forced answer copies the path, so its
    label is high. The toy ends that answer at `}\\n` and writes more boxes after it, so a
    continuation read from its last box, unstopped (the release's reading), labels them about 0."""
    import evaluate
    import data
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from evaluation import confidence
    from evaluation.confidence import think_end
    from rollout import generate
    assert slipped("3+5+7+2", "3+5=8\n8+7=14?\n14+2=16\n16") and slipped("3+5+7+2", "3+5=8\n9+7=16\n")
    assert not slipped("3+5+7", "3+5=8\n8+7=15\n</think>\\boxed{15}") and not slipped("3+5+7+2", "3+5=8\n8+7=1")
    seen = {}
    monkeypatch.setattr(confidence, "posthoc_probe", lambda cache, model, tok, questions, instruction, close_id,
                        protocol, **kw: seen.update(rows=questions, p=protocol) or (None, {}))
    confidence.get_probe("probe-posthoc", None, None, "base", toy.BASE_DIR, str(tmp_path),
                     evaluate.parse_args(["--model", "toy"]), 0)
    p, rows = seen["p"], seen["rows"][:16]
    model = AutoModelForCausalLM.from_pretrained(toy.BASE_DIR).eval()
    tok = AutoTokenizer.from_pretrained(toy.BASE_DIR)
    asked = [data.chat_prompt(tok, r["problem"], toy.INSTRUCTION) for r in rows]
    out = generate(model, tok, asked, n=4, max_new_tokens=p["max_new_tokens"], temperature=p["temperature"],
                   top_p=p["top_p"], seed=0)
    ends = [think_end(r, tok.convert_tokens_to_ids("</think>")) for r in out.ids]
    positions = [confidence.posthoc_budgets(e, p["every"], p["count"]) for e in ends]
    labels, _ = confidence.posthoc_labels(model, tok, [asked[i] for i in out.prompt_index], out.ids, out.texts,
                                       [rows[i]["answer"] for i in out.prompt_index], positions, ends,
                                       dict(p, seed=1))
    cuts = {False: [], True: []}   # in-thinking labels before any wrong total, and after one
    for r, i, ps, e, ys in zip(out.ids, out.prompt_index, positions, ends, labels):
        for b, y in zip(ps, ys):
            if b < e:
                cuts[slipped(rows[i]["problem"], tok.decode(r[:b]))].append(y)
    mean = {slipped: sum(ys) / max(len(ys), 1) for slipped, ys in cuts.items()}
    print(f"\nin-thinking labels: {len(cuts[False])} clean, mean {mean[False]:.3f}; "
          f"{len(cuts[True])} after a wrong total, mean {mean[True]:.3f}")
    assert len(cuts[False]) >= 60 and mean[False] >= 0.9
    assert len(cuts[True]) >= 10 and mean[True] <= 0.1   # the label reads the path: not always right
