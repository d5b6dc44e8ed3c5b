"""``benchmarks.output_hashes``: the fingerprints that show a change moved no output bit."""

import torch

from benchmarks import output_hashes, registry


def test_digest_sees_one_bit_and_the_dtype():
    x = torch.randn(5, 3).half()
    y = x.clone()
    y.view(torch.int16)[2, 1] ^= 1  # one ulp
    assert output_hashes.digest(x) == output_hashes.digest(x.clone())
    assert output_hashes.digest(x) != output_hashes.digest(y)
    assert output_hashes.digest(x.view(torch.int16)) != output_hashes.digest(x)


def test_hashes_are_stable_and_a_changed_route_is_reported():
    scn = registry.BY_NAME["tiny-decode"]
    first = output_hashes.hashes([scn], "cpu")
    again = output_hashes.hashes([scn], "cpu")
    routes = first[scn.name]
    assert set(routes) == {"xqa", "splitk", "invariant", "auto"}
    assert all("error" not in v and v["finite"] for v in routes.values()), routes
    assert output_hashes.differences(first, again) == []
    # Known-wrong: a route whose output moved, one that now raises, a scenario that is gone.
    moved = {scn.name: dict(routes, xqa=dict(routes["xqa"], out="0" * 64))}
    assert output_hashes.differences(first, moved) == [f"tiny-decode:xqa: {routes['xqa']} -> {moved[scn.name]['xqa']}"]
    broken = {scn.name: dict(routes, splitk=dict(error="RuntimeError: x"))}
    assert [d.split(":")[1] for d in output_hashes.differences(first, broken)] == ["splitk"]
    assert output_hashes.differences(first, {}) == ["tiny-decode: only in the saved table"]


def test_cli_writes_as_it_goes_and_compares_a_subset(tmp_path, monkeypatch, capsys):
    """``--out`` holds every scenario hashed so far (a run cut short keeps them); ``--compare`` with
    ``--scenario`` reruns only the named ones of the saved table, and a moved hash among them exits 1."""
    import json

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "h.json"
    seen = []
    real = output_hashes.hashes

    def watching(scenarios, device, log=None, after=None):
        def after_each(table):
            after(table)
            seen.append(sorted(json.loads(out.read_text())["hashes"]))
        return real(scenarios, device, log=log, after=after_each)

    monkeypatch.setattr(output_hashes, "hashes", watching)
    assert output_hashes.main(["--device", "cpu", "-s", "tiny-decode", "-s", "tiny-prefill", "--out", str(out)]) == 0
    assert seen == [["tiny-prefill"], ["tiny-decode", "tiny-prefill"]]  # in run order
    assert output_hashes.main(["--device", "cpu", "--compare", str(out), "-s", "tiny-decode"]) == 0
    assert "1 scenarios compared: 0 differences" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    saved["hashes"]["tiny-decode"]["xqa"]["out"] = "0" * 64  # known-wrong: a moved output
    out.write_text(json.dumps(saved))
    assert output_hashes.main(["--device", "cpu", "--compare", str(out), "-s", "tiny-decode"]) == 1
    assert "DIFFERS tiny-decode:xqa" in capsys.readouterr().out
