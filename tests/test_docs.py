"""No dangling references: every file the project names is in the repository, and every name it cites
(`module.name`, `file.py:name`, `file.py::test`) is defined there (the last tests below).

What counts as a name: a `NAME.py` or `NAME.md` (with or without folders before it) or a `docs/...`
path, anywhere in the project's .py files (comments, docstrings, strings; this file's own examples
aside), README.md and docs/*.md, and in the `--help` text of train.py and evaluate.py. A name with a
folder must exist from the repository root or from the folder of the file that names it; a bare
name must be a file somewhere in the repository (so a reader can find it).

Not checked:
- paths that start with `../shared/`: the developers' reference folder, named as such where cited;
- the names in ELSEWHERE, each with its reason. An entry ending in "/" is a folder of another project
  or of a run's outputs and covers every path under it: the map (docs/reference.md) names the released code's
  files under `verl/` and `scripts/eval/` (the authors' repository). This repository has neither
  folder (checked below), so a path under one is never one of its own files.
"""
import ast
import io
import os
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.relpath(os.path.abspath(__file__), ROOT)  # its examples name missing files on purpose
NAME = re.compile(r"(?<![\w./-])((?:\.\./)?[\w./-]*\w\.(?:py|md)|docs/[\w./-]*\w)(?![\w/])")
SKIP_DIRS = ("runs", "out", "eval_out", "mutants")  # what runs and mutmut write (.gitignore), besides hidden folders
ELSEWHERE = {
    "verl/": "the released code (the authors' repository; the map in docs/reference.md)",
    "scripts/eval/": "the released code's evaluation scripts (the map in docs/reference.md)",
    "core_algos.py": "verl's policy-loss file in the released code (the map in docs/reference.md)",
    "study/": "the finished toy study's code, at commit 51f0271 (docs/toy-world.md, \"Rerunning the study\")",
    "OUT/": "a command's --out folder (reproduce.py writes OUT/table.md)",
    "runs/": "the run folders training and reproduce.py write",
    "table.md": "the table reproduce.py writes into its --out folder",
    "file.py": "a placeholder: `file.py:function` (tests/test_map.py)",
    "modeling_evil.py": "written by tests/test_train.py into a temporary checkpoint",
    "work.py": "a worker script tests/test_launch.py writes into a temporary folder",
    "vllm_sample.py": "the vLLM script docs/reference.md shows, saved by the user (\"Responses made elsewhere\")",
    "FILE.py": "a placeholder: --grader FILE.py:FUNCTION, the user's own grader (README)",
    "mine.py": "a user's grader file in grade.py's example and tests/test_user_grader.py",
    "wandb.py": "the stand-in tracker module tests/test_long_run.py writes into a temporary folder",
}


def project_files():
    """Paths (relative to ROOT) of every file in the repository, hidden and output folders aside."""
    out = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d not in SKIP_DIRS]
        out += [os.path.relpath(os.path.join(top, f), ROOT) for f in files]
    return out


def dangling(text, where, files):
    """The names in `text` (from file `where`, relative to ROOT) that are not in the repository."""
    names = {os.path.basename(f) for f in files}
    bad = []
    for name in NAME.findall(text):
        if name.startswith("../shared/") or name in ELSEWHERE or \
                any(name.startswith(k) for k in ELSEWHERE if k.endswith("/")):
            continue
        if "/" in name:
            ok = any(os.path.exists(os.path.join(ROOT, base, name)) for base in ("", os.path.dirname(where)))
        else:
            ok = name in names
        if not ok:
            bad.append(f"{where}: {name}")
    return bad


def test_the_name_pattern_finds_what_it_must():
    found = NAME.findall('see DESIGN.md "Scale" (docs/design.md, step.py:rlcm_step; ../shared/x.md) '
                         '`verl/verl/utils/reward_score/rlcr.py`, runs/toy/curves.png, x.pyc')
    assert found == ["DESIGN.md", "docs/design.md", "step.py", "../shared/x.md",
                     "verl/verl/utils/reward_score/rlcr.py"]


def test_the_released_codes_folders_are_not_ours():
    for folder in ("verl/", "scripts/eval/"):
        assert not os.path.exists(os.path.join(ROOT, folder)), \
            f"{folder} is now a folder of this repository: drop it from ELSEWHERE"


def test_every_file_named_in_the_code_and_the_docs_exists():
    files = project_files()
    texts = [f for f in files if f != HERE and (f.endswith(".py") or f == "README.md"
             or (f.startswith("docs" + os.sep) and f.endswith(".md")))]
    assert "README.md" in texts and "train.py" in texts
    bad = []
    for f in texts:
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            bad += dangling(fh.read(), f, files)
    assert not bad, "named but not in the repository:\n" + "\n".join(bad)


def test_help_texts_name_only_files_of_the_repository():
    files = project_files()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for script in ("train.py", "evaluate.py"):
        p = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                           env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        assert "usage:" in p.stdout
        bad = dangling(p.stdout, script + " --help", files)
        assert not bad, "named but not in the repository:\n" + "\n".join(bad)


def test_every_cited_section_of_the_design_notes_is_a_heading():
    files = project_files()
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        headings = {line.lstrip("#").strip() for line in f if line.startswith("## ")}
    cited = []
    for name in (f for f in files if f.endswith(".py") and f != HERE):
        with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
            cited += [(name, s) for s in re.findall(r'docs/design\.md, "([^"]+)"', fh.read())]
    assert len(cited) >= 8
    missing = [f"{name}: {s}" for name, s in cited if s not in headings]
    assert not missing, "cited sections that docs/design.md does not have:\n" + "\n".join(missing)


def test_the_readme_opens_with_the_one_screen_step_as_it_is_in_the_code():
    """The README's first code block is `train.rl_step` verbatim, so the algorithm a reader meets
    first is the one train.py runs, not a paraphrase that can drift."""
    import inspect
    import train
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    first = re.search(r"```(\w*)\n(.*?)```", text, re.S)
    assert first.group(1) == "python"
    assert first.group(2).rstrip("\n") == inspect.getsource(train.rl_step).rstrip("\n")
    assert text.index(first.group(0)) < text.index("## Two commands")
    assert len(text.splitlines()) <= 220, "the README is for a learner: reference material goes to docs/"


def test_the_readmes_sentences_are_short():
    """A newcomer reads the README once: its median prose sentence is at most 22 words (nanoGPT's
    README about 16-18, nanochat's 20). Prose is what is left without fenced code, tables and
    headings; a sentence ends at . ! or ? before a capital, a backtick or an opening bracket."""
    import statistics
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    prose = " ".join(line for line in text.splitlines() if not line.lstrip().startswith(("|", "#")))
    words = [len(s.split()) for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(\[])", prose)]
    words = [n for n in words if n >= 3]  # "See below." and the like are not sentences
    assert len(words) >= 20 and statistics.median(words) <= 22, sorted(words)


# A cited name: `module.name`, `file.py:name` or `file.py::name` (a test), the name maybe `Class.method`.
CITED = re.compile(r"(?<![\w./-])(?:([\w/]+\.py)::?|([A-Za-z_]\w*)\.)([A-Za-z_][\w.:]*\w)")
PACKAGES = ("harness", "evaluation", "tests")
EXTENSIONS = {"py", "md", "json", "jsonl", "pt", "png", "txt", "log"}  # `config.json` is a file, not a name
NOT_NAMES = {  # cited names whose first part is a module's name but that are not that module's
    "samples.ids": "a field of the Samples that rollout.py's docstring calls samples",
    "train.jsnol": "the mistyped file name data.py's docstring gives as an example",
    "probe.reward_mode": "a setting of the released code (the map in docs/reference.md)",
    "probe.reward_weight": "a setting of the released code (the map in docs/reference.md)",
}


def modules():
    """Each project module's name -> its file: the top-level .py files and those of PACKAGES."""
    files = [f for f in project_files() if f.endswith(".py") and os.path.dirname(f) in ("",) + PACKAGES]
    return {os.path.basename(f)[:-3]: f for f in files if not f.endswith("__init__.py")}


def defined(path):
    """What the module at `path` defines at its top level: name -> the names its class defines (None
    for a function or a value)."""
    def names(body):
        out = {}
        for node in body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = set(names(node.body))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = None
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out |= dict.fromkeys(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):  # a name imported is the module's too
                out |= dict.fromkeys((a.asname or a.name).split(".")[0] for a in node.names)
            elif hasattr(node, "body"):  # if, try, with
                out |= names(node.body + getattr(node, "orelse", []))
        return out
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return names(ast.parse(f.read()).body)


def prose(path):
    """The comments and docstrings of a .py file, or the whole of a .md file."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    if not path.endswith(".py"):
        return text
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
    docs = [ast.get_docstring(n) or "" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return "\n".join(comments + docs)


def retired_modules():
    """The modules this repository once had and has no more, by name (git's deleted files): a
    name cited as `old.name` after old.py went is stale. Empty without git."""
    try:
        log = subprocess.run(["git", "-C", ROOT, "log", "--diff-filter=D", "--name-only",
                              "--format="], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    gone = {os.path.basename(f)[:-3] for f in log.split()
            if f.endswith(".py") and os.path.dirname(f) in ("",) + PACKAGES}
    return gone - set(modules()) - {"__init__"}


def stale_names(text, where, mods, gone=()):
    """The names cited in `text` (from file `where`) that their project module does not define, and
    those whose module is one of `gone`, which this repository no longer has."""
    bad = []
    for m in CITED.finditer(text):
        file, first, rest = m.groups()
        parts = rest.replace("::", ".").split(".")
        if file:
            module, near = os.path.basename(file)[:-3], os.path.join(os.path.dirname(where), file)
            path = next((p for p in (file, near) if os.path.exists(os.path.join(ROOT, p))),
                        mods.get(module))
        elif first in PACKAGES:
            module, parts = parts[0], parts[1:]
            path = mods.get(module)
        else:
            module, path = first, mods.get(first)
        if not parts or parts[-1] in EXTENSIONS or m.group(0) in NOT_NAMES:
            continue
        if not path:  # not a module of this repository: one it no longer has, or none of its own
            if module in gone:
                bad.append(f"{where}: {m.group(0)} (no {module}.py here any more)")
            continue
        defs = defined(path)
        members = defs.get(parts[0], set())
        if parts[0] not in defs or len(parts) > 1 and members is not None and parts[1] not in members:
            bad.append(f"{where}: {m.group(0)}")
    return bad


def test_a_wrong_name_is_found_and_other_names_are_left_alone(tmp_path):
    (tmp_path / "mod.py").write_text("import os as system\n"
                                     "class Probe:\n    size: int = 4\n    def fit(self): ...\n"
                                     "def test_fit(): ...\n"
                                     "if True:\n    LIMIT = 1\n")
    mods = {"mod": str(tmp_path / "mod.py")}
    right = "mod.Probe.fit (mod.py:Probe.size, tests/mod.py::test_fit, `harness.mod.LIMIT`, mod.system) " \
            "mod.LIMIT.real, torch.nn, a.py:12, self.Probe, mod.jsonl, mod.py."
    wrong = "mod.Probe.fitt, mod.py:nope, tests/mod.py::test_x, harness.mod.Nope, mod.probe"
    assert stale_names(right, "README.md", mods) == []
    assert stale_names(wrong, "README.md", mods) == ["README.md: " + n for n in wrong.split(", ")]
    # a module that is gone: its names are reported, not skipped; one never here is left alone
    gone = "`old.forward_pass`, old.py:score, harness.old.x, torch.nn"
    assert stale_names(gone, "docs/x.md", mods) == []
    names = ("old.forward_pass", "old.py:score", "harness.old.x")
    reported = [f"docs/x.md: {n} (no old.py here any more)" for n in names]
    assert stale_names(gone, "docs/x.md", mods, {"old"}) == reported


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".git")), reason="no git history to read")
def test_a_name_of_a_module_this_repository_removed_is_reported():
    """update.py went (its forward_pass is label.py's now): a doc citing the function under its old
    module fails; step.py and modes.py are known gone too."""
    gone = retired_modules()
    assert {"update", "step", "modes"} <= gone and not gone & set(modules())
    assert stale_names("see `update.forward_pass`", "docs/design.md", modules(), gone) == [
        "docs/design.md: update.forward_pass (no update.py here any more)"]


def test_every_name_cited_in_the_comments_and_the_docs_exists():
    mods = modules()
    texts = [f for f in project_files() if f.endswith(".py") or f == "README.md"
             or (f.startswith("docs" + os.sep) and f.endswith(".md"))]
    assert any(f.startswith("docs" + os.sep) for f in texts)
    gone = retired_modules()
    bad = {b for f in texts for b in stale_names(prose(f), f, mods, gone)}
    assert not bad, "cited but not defined:\n" + "\n".join(sorted(bad))
