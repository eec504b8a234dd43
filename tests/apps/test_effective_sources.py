"""``config effective``: where each field comes from, when a script default applies, and who an error blames
(:mod:`kvbm_backend.apps.effective`, in process, with real config files). Review findings (2026-11-30):

* a section variable (``KVBM_BACKEND__G3='{"capacity_gb": 5}'``) counted as setting every field of its section,
  so the script's ``g3.paths`` default was dropped (G3 opened in ./kvbm-g3) and the line said
  ``g3.paths=./kvbm-g3 [env KVBM_BACKEND__G3]``;
* a bad ``--default`` was reported as coming from the ``KVBM_BACKEND__...`` variable it is exported as, which the
  operator never set.
The launch scripts themselves run in tests/examples/test_example_effective.py.
"""
from __future__ import annotations

import pytest

from kvbm_backend.apps.effective import EffectiveError, Source, effective

DEFAULTS = {"g3.paths": ["/mnt/nvme0/kvbm"], "g3.capacity_gb": 800}


@pytest.fixture
def bare(tmp_path):
    p = tmp_path / "bare.yaml"
    p.write_text("model: m\n")
    return Source(str(p))


def test_a_section_variable_sets_only_its_fields(bare):
    cfg, exports, where = effective(bare, DEFAULTS, {"KVBM_BACKEND__G3": '{"capacity_gb": 5}'})
    assert exports == {"KVBM_BACKEND__G3__PATHS": '["/mnt/nvme0/kvbm"]'}
    assert (cfg.g3.paths, cfg.g3.capacity_gb) == (["/mnt/nvme0/kvbm"], 5)
    assert (where["g3.paths"], where["g3.capacity_gb"], where["g3.enabled"]) == (
        "script", "env KVBM_BACKEND__G3", "default")


def test_a_section_variable_holding_the_field_wins_and_is_named(bare, tmp_path):
    g3 = str(tmp_path / "env-g3")
    env = {"KVBM_BACKEND__G3": f'{{"paths": ["{g3}"]}}', "DYN_KVBM_DISK_CACHE_GB": "3"}
    cfg, exports, where = effective(bare, DEFAULTS, env)
    assert exports == {} and (cfg.g3.paths, cfg.g3.capacity_gb) == ([g3], 3)
    assert (where["g3.paths"], where["g3.capacity_gb"]) == ("env KVBM_BACKEND__G3", "env DYN_KVBM_DISK_CACHE_GB")
    # the deeper variable wins, and is the one named
    env["KVBM_BACKEND__G3__PATHS"] = f'["{g3}-2"]'
    cfg, _, where = effective(bare, DEFAULTS, env)
    assert cfg.g3.paths == [f"{g3}-2"] and where["g3.paths"] == "env KVBM_BACKEND__G3__PATHS"


def test_a_bad_default_is_blamed_on_the_default_not_a_variable(bare):
    with pytest.raises(EffectiveError, match=r"^g3\.paths \(from --default g3\.paths\): Input should be a valid list"):
        effective(bare, {"g3.paths": "/x"}, {})
    with pytest.raises(EffectiveError, match=r"^nosuch \(from --default nosuch\.field\): Extra inputs"):
        effective(bare, {"nosuch.field": 1}, {})
    # the operator's own variable of that name: the default is not applied, the variable is named
    with pytest.raises(EffectiveError, match=r"^g3\.paths \(from KVBM_BACKEND__G3__PATHS\): Input should be a valid"):
        effective(bare, {"g3.paths": "/x"}, {"KVBM_BACKEND__G3__PATHS": "/y"})
