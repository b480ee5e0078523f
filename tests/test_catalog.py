"""Tier 3: the catalog loads, validates, and refuses broken data with a message naming the problem."""

import copy

import pytest
import yaml

from rigforge.model.catalog import CATALOG_PATH, CatalogError, load_catalog, parse_catalog
from rigforge.model.fleet import resolve

PRIMARY = ["dual", "dual-turbo", "dual-dflash", "dual-dflash-noviz", "carnice-bf16mtp"]


@pytest.fixture
def raw():
    return yaml.safe_load(CATALOG_PATH.read_text())


def test_catalog_has_the_five_variants_of_the_design_document():
    assert list(load_catalog().variants) == PRIMARY


@pytest.mark.parametrize(
    "name,port,assets",
    [
        ("dual", 8010, ("autoround-int4",)),
        ("dual-turbo", 8011, ("autoround-int4",)),
        ("dual-dflash", 8012, ("autoround-int4", "dflash-draft")),
        ("dual-dflash-noviz", 8013, ("autoround-int4", "dflash-draft")),
        ("carnice-bf16mtp", 8070, ("carnice",)),
    ],
)
def test_ports_and_assets(name, port, assets):
    v = load_catalog().variants[name]
    assert (v.port, v.assets, v.gpus) == (port, assets, 2)


def test_dual_turbo_carries_all_48_genesis_variables():
    env = dict(load_catalog().variants["dual-turbo"].environment)
    genesis = [k for k in env if k.startswith("GENESIS_")]
    assert len(genesis) == 48
    assert env["GENESIS_ENABLE_P87"] == "0"  # marlin.py is mounted read-only
    assert "GENESIS_ENABLE_PN34_WORKSPACE_LOCK_RELAX" not in env


def test_only_dflash_variants_are_flagged_dflash_and_refuse_20gb_cards():
    c = load_catalog()
    assert [n for n in c.variants if c.variants[n].uses_dflash] == ["dual-dflash", "dual-dflash-noviz"]
    assert [n for n in c.variants if not c.variants[n].fits_20gb_cards] == ["dual-dflash", "dual-dflash-noviz"]


def test_unknown_variant_names_the_choices():
    with pytest.raises(CatalogError, match="unknown variant 'dual-tubro'; choose one of: dual, dual-turbo"):
        resolve("dual-tubro", None, opt_in=False)  # a name without "/" is the catalog's: the lock is not read


def _broken(raw, mutate):
    data = copy.deepcopy(raw)
    mutate(data)
    return data


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(version=2), "unsupported version 2"),
        (lambda d: d["variants"]["dual"].pop("port"), "variant 'dual': missing key 'port'"),
        (lambda d: d["variants"]["dual"].update(port="8010"), "'port' must be int"),
        (lambda d: d["variants"]["dual"].update(port=70000), "port 70000 out of range"),
        (lambda d: d["variants"]["dual"].update(colour="red"), "unknown keys \\['colour'\\]"),
        (lambda d: d["variants"]["dual"].update(assets=["nope"]), "unknown asset 'nope'"),
        (lambda d: d["variants"]["dual"].update(gpus=4), "--tensor-parallel-size must equal gpus"),
        (lambda d: d["variants"]["dual"]["args"].append(["model"]), "'model' is not a --flag"),
        (
            lambda d: d["variants"]["dual"]["mounts"].append({"host": "/x", "container": "/y"}),
            "must start with",
        ),
        (lambda d: d["variants"]["dual"]["environment"].update(X=1), "environment X must be a string"),
        (lambda d: d.update(variants={}), "no variants"),
    ],
)
def test_broken_catalogs_are_refused(raw, mutate, message):
    with pytest.raises(CatalogError, match=message):
        parse_catalog(_broken(raw, mutate))


def test_unreadable_catalog_file(tmp_path):
    bad = tmp_path / "v.yaml"
    bad.write_text("variants: [unclosed")
    with pytest.raises(CatalogError, match="catalog .*v.yaml"):
        load_catalog(bad)
