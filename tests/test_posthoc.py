"""evaluation/confidence.py: the post-hoc probe's cache is used only when whole and of the same
protocol, and is fitted again (with one line) when damaged; NaN features are refused."""
import json
import math
import os

import pytest
import torch

import probe as probe_lib
from evaluation import confidence


def test_a_cut_between_the_posthoc_caches_two_files_never_pairs_another_protocols_probe(tmp_path, monkeypatch, capsys):
    # H8: at a7c59f5 the report (.json, with the protocol) and the probe (.pt) were two files: after a
    # kill between them a new .pt sat beside the old .json, and the old protocol got the other probe.
    import torch
    from evaluation import confidence
    import probe as probe_lib
    from harness import files
    import test_posthoc as hi
    cache = hi.cache_files(tmp_path)            # protocol A's probe and report, both in c.pt
    files.write_json(cache + ".json", {"protocol": confidence.cache_protocol(hi.PROTOCOL, [], "")})
    other = probe_lib.Probe(8)
    with torch.no_grad():
        other.net[0].weight.fill_(0.5)
    # the state a kill after the first write of the old layout left: another protocol's probe in c.pt,
    # A's report in c.json (here the probe comes with its own protocol, as posthoc_probe writes it)
    probe_lib.save(cache + ".pt", other)
    torch.save(dict(torch.load(cache + ".pt"), report=json.dumps({"protocol": dict(hi.PROTOCOL, n=8)})), cache + ".pt")
    with pytest.raises(hi.Refit):               # protocol A is fitted again, not answered with n=8's probe
        hi.cached_probe(cache, monkeypatch)
    probe_lib.save(cache + ".pt", probe_lib.Probe(8))
    torch.save(dict(torch.load(cache + ".pt"), report=json.dumps({"protocol": confidence.cache_protocol(
        hi.PROTOCOL, [], "")})), cache + ".pt")
    prb, report = hi.cached_probe(cache, monkeypatch)   # A's own file: used as it is
    assert report["protocol"]["n"] == 1 and prb.net[0].weight.abs().max().item() != 0.5


# what posthoc_probe compares with the cached report's protocol
PROTOCOL = dict(stop=[], n=1, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=0)


def cache_files(tmp_path):
    """A good post-hoc cache (probe and report in c.pt) under tmp_path / c, for PROTOCOL and no questions."""
    probe_lib.save(str(tmp_path / "c.pt"), probe_lib.Probe(8),
                   report=json.dumps({"protocol": confidence.cache_protocol(PROTOCOL, [], "")}))
    return str(tmp_path / "c")


class Refit(Exception):
    """Raised where posthoc_probe starts sampling to fit the probe again."""


def cached_probe(cache, monkeypatch):
    def refit(*a, **k):
        raise Refit
    monkeypatch.setattr(confidence, "generate_dealt", refit)
    return confidence.posthoc_probe(cache, None, None, [], "", None, PROTOCOL)


def nan_weights(path):
    blob = torch.load(path, weights_only=True)
    torch.save(dict(blob, state_dict={k: torch.full_like(v, math.nan) for k, v in blob["state_dict"].items()}), path)


CACHE_CASES = {   # what is done to the cache, the file named, words of the reason
    "pt cut in half": (lambda c: os.truncate(c + ".pt", os.path.getsize(c + ".pt") // 2), ".pt", "damaged ("),
    "pt a list": (lambda c: torch.save([1, 2], c + ".pt"), ".pt", "(a list, not a dict)"),
    "pt a pickle payload": (lambda c: torch.save({"x": os.system}, c + ".pt"), ".pt",
                            "(it holds objects other than tensors; not loaded)"),
    "pt NaN weights": (lambda c: nan_weights(c + ".pt"), ".pt", "holds NaN or inf probe weights"),
    "pt without its report": (lambda c: probe_lib.save(c + ".pt", probe_lib.Probe(8)), ".pt",
                              "(it holds no report (an older version's file))"),
    "pt report a list": (lambda c: probe_lib.save(c + ".pt", probe_lib.Probe(8), report="[]"), ".pt",
                         "(it holds no report"),
}


@pytest.mark.parametrize("case", CACHE_CASES)
def test_a_damaged_posthoc_cache_is_named_in_one_line_and_fitted_again(case, tmp_path, capsys, monkeypatch):
    damage, ext, words = CACHE_CASES[case]
    cache = cache_files(tmp_path)
    prb, report = cached_probe(cache, monkeypatch)   # the good cache is used as it is
    assert prb.dim == 8 and report == {"protocol": confidence.cache_protocol(PROTOCOL, [], "")}
    damage(cache)
    with pytest.raises(Refit):   # 81f6578: TypeError, a torch traceback, or the NaN probe returned
        cached_probe(cache, monkeypatch)
    line, fitting = capsys.readouterr().err.splitlines()   # the warning, then the fit's first phase
    assert fitting.startswith("post-hoc probe: fitting it")
    assert line.startswith(f"warning: post-hoc probe cache {cache}{ext} is damaged") and words in line, line
    assert "weights_only" not in line and line.endswith("fitting the probe again")


def test_posthoc_fit_on_nan_features_says_so():
    x = torch.randn(40, 8)
    x[3, 1] = math.nan
    with pytest.raises(FloatingPointError, match="post-hoc probe: 1 of 40 features are NaN or inf"):
        confidence.fit_posthoc(x, torch.rand(40), torch.arange(40) // 4, dict(seed=42, batch=64))
