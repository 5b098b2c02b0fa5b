"""tools/wheelhouse.py's rules that need no index: one version of each package, the size limit, the target's tags."""

from __future__ import annotations

import json

import pytest

from tools import wheelhouse


def _wheel(directory, name, size=1000):
    path = directory / name
    path.write_bytes(b"x" * size)
    return path


def test_manifest_lists_name_version_sha256_and_size(tmp_path):
    _wheel(tmp_path, "hjson-3.1.0-py3-none-any.whl", 100)
    _wheel(tmp_path, "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl", 300)
    manifest = wheelhouse.write_manifest(tmp_path, "3.12", ["--platform", "x"], 1.0, ["numpy"])
    assert [(w["name"], w["version"], w["size"]) for w in manifest["wheels"]] == [("hjson", "3.1.0", 100),
                                                                                 ("pydantic-core", "2.50.5", 300)]
    assert manifest["wheels"][0]["sha256"] == __import__("hashlib").sha256(b"x" * 100).hexdigest()
    assert manifest["total_bytes"] == 400 and "numpy" in manifest["left_out"] and "torch" in manifest["left_out"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    assert "total 400 bytes" in (tmp_path / "manifest.txt").read_text()


def test_two_versions_of_a_package_are_refused(tmp_path):
    _wheel(tmp_path, "hjson-3.1.0-py3-none-any.whl")
    _wheel(tmp_path, "hjson-3.0.0-py3-none-any.whl")
    with pytest.raises(SystemExit, match=r"more than one version of \['hjson'\]"):
        wheelhouse.write_manifest(tmp_path, "3.12", [], 1.0, [])
    assert not (tmp_path / "manifest.json").exists()


def test_over_the_size_limit_is_refused_naming_the_largest(tmp_path):
    _wheel(tmp_path, "transformers-5.24.0-py3-none-any.whl", 2 * 2**20)
    _wheel(tmp_path, "hjson-3.1.0-py3-none-any.whl", 10)
    with pytest.raises(SystemExit, match=r"2\.0 MiB is over the 1 MiB limit; largest: transformers-5\.24\.0"):
        wheelhouse.write_manifest(tmp_path, "3.12", [], 1.0, [])
    assert not (tmp_path / "manifest.json").exists()


def test_target_flags_name_every_manylinux_glibc_and_the_cpython_abi():
    flags = wheelhouse.target_flags("3.12", None) if wheelhouse.sys.version_info[:2] != (3, 12) else \
        wheelhouse.target_flags("3.12", 35)
    assert flags[:2] == ["--python-version", "3.12"] and "cp312" in flags and "--only-binary=:all:" in flags
    platforms = [flags[i + 1] for i, f in enumerate(flags) if f == "--platform"]
    assert [f"manylinux_2_{n}_x86_64" for n in range(17, 36)] == platforms[:19]
    assert "manylinux2014_x86_64" in platforms
    assert wheelhouse.target_environment("3.12")["python_version"] == "3.12"


def test_a_python_version_that_is_not_one_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        wheelhouse.main(["--python", "python3.12"])
    assert e.value.code == 2 and "expected a CPython version such as 3.12" in capsys.readouterr().err
