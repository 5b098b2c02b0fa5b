"""tools/node_install.py: the wheels a node with its own torch needs, chosen without pip's resolver, on a made-up
wheelhouse over this environment's installed packages (the "node")."""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
import zipfile
from pathlib import Path

from tools import node_install


def _wheel(house: Path, name: str, version: str, requires: list[str]) -> dict:
    file = f"{name}-{version}-py3-none-any.whl"
    meta = "\n".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}"]
                     + [f"Requires-Dist: {r}" for r in requires]) + "\n\nA description: Requires-Dist: not-me\n"
    with zipfile.ZipFile(house / file, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return {"name": name, "version": version, "file": file}


def _house(tmp_path: Path, wheels: list[tuple[str, str, list[str]]], requirements: str) -> tuple[Path, Path]:
    house = tmp_path / "wheelhouse"
    house.mkdir()
    manifest = {"wheels": [_wheel(house, *w) for w in wheels]}
    (house / "manifest.json").write_text(json.dumps(manifest))
    req = tmp_path / "requirements-node.txt"
    req.write_text(requirements)
    return house, req


def test_takes_what_is_missing_or_too_old_keeps_what_satisfies_and_never_walks_a_kept_packages_requirements(
        tmp_path):
    psutil = md.version("psutil")
    house, req = _house(tmp_path, [
        ("alpha", "1.0", ["beta>=2", "pyyaml>=5", 'gamma; extra == "docs"', 'delta; python_version < "3"']),
        ("beta", "2.0", []), ("gamma", "1.0", []), ("delta", "1.0", []),
        ("psutil", "999.0", []),  # only taken when the node's is too old
        ("pyyaml", "999.0", []),
    ], "# a comment\nalpha==1.0\npsutil>=999  # the node's is older\ntorch>=2.0\n")
    take, keep, unmet = node_install.walk(house, req)
    assert sorted(take) == ["alpha", "beta", "psutil"] and unmet == []
    assert keep["pyyaml"] == md.version("pyyaml") and keep["torch"] == md.version("torch")  # the node's
    assert "filelock" not in keep and "sympy" not in keep  # torch's own requirements: not walked
    assert psutil != "999.0"


def test_an_unmet_requirement_is_named_with_its_source_and_what_there_is(tmp_path, capsys):
    house, req = _house(tmp_path, [("alpha", "1.0", ["numpy>=999", "beta>=3"]), ("beta", "2.0", [])], "alpha\n")
    assert node_install.main([str(house), str(req), "plan"]) == 2
    err = capsys.readouterr().err
    assert f"numpy>=999 (from alpha-1.0-py3-none-any.whl): the node's {md.version('numpy')}" in err
    assert "beta>=3 (from alpha-1.0-py3-none-any.whl): the wheelhouse's 2.0" in err


def test_plan_prints_the_files_and_check_fails_while_any_is_still_missing(tmp_path, capsys):
    house, req = _house(tmp_path, [("alpha", "1.0", ["pyyaml"])], "alpha\n")
    assert node_install.main([str(house), str(req), "plan"]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [str(house / "alpha-1.0-py3-none-any.whl")]
    assert f"kept from the node: pyyaml {md.version('pyyaml')}" in err
    assert node_install.main([str(house), str(req), "check"]) == 2
    assert "still missing after the install: alpha" in capsys.readouterr().err


def test_packaging_imported_from_the_wheelhouse_leaves_no_wheel_on_the_path(tmp_path):
    """A wheel left on sys.path would make importlib.metadata count it as installed on the node (found by the
    offline-env test: packaging "kept from the node", then DeepSpeed's import failed)."""
    house, _ = _house(tmp_path, [], "")
    dist = md.distribution("packaging")
    with zipfile.ZipFile(house / f"packaging-{dist.version}-py3-none-any.whl", "w") as zf:
        for f in dist.files or []:
            if not str(f).startswith(".."):
                zf.write(dist.locate_file(f), str(f))
    before = list(sys.path)
    node_install._packaging(house)
    assert sys.path == before
