"""kspeed errors reach Python with their own kind and class (the crate's one
mapping of every variant, shared with the C ABI): these three used to fall
into a wildcard and come out as a bare kspeed.Error of kind "Other"."""

import os

import pytest

import kspeed

from conftest import cli, make_tree


def test_catalog_of_another_source_is_a_data_error_of_its_own_kind(tmp_path):
    a = make_tree(str(tmp_path / "a"), n=8)
    b = make_tree(str(tmp_path / "b"), n=8)
    catalog = tmp_path / "a.ksc"
    cli("catalog", "--source", a, "--out", catalog)
    with pytest.raises(kspeed.DataError) as e:
        kspeed.preload(source=b, space=str(tmp_path / "space"), catalog=str(catalog))
    assert e.value.kind == "CatalogOfAnotherSource", e.value
    assert "was built from" in str(e.value)


def test_a_fifo_in_the_source_is_a_data_error_of_kind_not_regular_file(tmp_path):
    src = make_tree(str(tmp_path / "src"), n=4)
    os.mkfifo(os.path.join(src, "ant", "pipe.bin"))
    with pytest.raises(kspeed.DataError) as e:
        kspeed.preload(source=src, space=str(tmp_path / "space"))
    assert e.value.kind == "NotRegularFile", e.value
    assert "pipe.bin" in str(e.value)


def test_a_symlink_leaving_the_source_is_a_data_error_of_its_own_kind(tmp_path):
    src = make_tree(str(tmp_path / "src"), n=4)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 100)
    os.symlink(outside, os.path.join(src, "ant", "link.bin"))
    with pytest.raises(kspeed.DataError) as e:
        kspeed.preload(source=src, space=str(tmp_path / "space"))
    assert e.value.kind == "SymlinkOutsideSource", e.value
    assert "link.bin" in str(e.value)
