"""The fingerprint tool that proves a refactor kept every number (fedhetero.lab.fingerprint)."""

from __future__ import annotations

import json

from fedhetero.lab import fingerprint as fp


def test_same_runs_give_the_same_fingerprint_and_a_change_is_named(tmp_path, capsys):
    for side in ("a", "b"):
        assert fp.main(["run", str(tmp_path / side), "--only", "fedavg-local"]) == 0
    a, b = tmp_path / "a" / "fingerprint.json", tmp_path / "b" / "fingerprint.json"
    assert json.loads(a.read_text())["fedavg-local"]["rounds"] == 4
    assert fp.main(["compare", str(a), str(b)]) == 0
    # a changed number in the metrics (not a wall-clock field) is caught
    rows = (tmp_path / "b" / "fedavg-local" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(rows[-1])
    last["wall_s"] = 123.0
    (tmp_path / "b" / "fedavg-local" / "metrics.jsonl").write_text("\n".join(rows[:-1] + [json.dumps(last)]) + "\n")
    assert fp.fingerprint(tmp_path / "b" / "fedavg-local") == json.loads(a.read_text())["fedavg-local"]
    last["loss"] += 1e-12
    (tmp_path / "b" / "fedavg-local" / "metrics.jsonl").write_text("\n".join(rows[:-1] + [json.dumps(last)]) + "\n")
    b.write_text(json.dumps({"fedavg-local": fp.fingerprint(tmp_path / "b" / "fedavg-local")}))
    capsys.readouterr()
    assert fp.main(["compare", str(a), str(b)]) == 1
    assert "fedavg-local: DIFFERS" in capsys.readouterr().out
