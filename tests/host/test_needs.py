"""``numba_flash.needs``: what is missing, said in one line with the extra of setup.cfg that
installs it; ``numba_flash.torch`` without torch."""

from __future__ import annotations

import configparser
import importlib
import pathlib
import re
import sys

import pytest

from numba_flash import needs

SETUP_CFG = pathlib.Path(__file__).resolve().parents[2] / "setup.cfg"


def test_every_hint_names_an_extra_of_setup_cfg_that_installs_the_package():
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    extras = config["options.extras_require"]
    for name, extra in needs.EXTRAS.items():
        assert extra in extras, f"{name}: no extra {extra!r} in setup.cfg"
        packages = [re.split(r"[<>=\[;\s]", line.strip())[0].replace("-", "_")
                    for line in extras[extra].strip().splitlines()]
        assert any(p == name or p.startswith(f"{name}_") for p in packages), (name, extra, packages)
        assert f"pip install 'numba-flash[{extra}]'" in needs.install_hint(name)


def test_unmet_needs_are_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as in an install without the extra
    assert needs.module("numpy") is None and needs.tool("python-that-is-not-here", "x") is not None
    assert needs.unmet("demo", None, needs.module("numpy")) is None
    with pytest.raises(SystemExit) as stop:
        needs.exit_unless("demo", needs.module("ml_dtypes"), needs.tool("ncu-not-here", "from the CUDA toolkit"))
    assert stop.value.code == needs.EXIT_STATUS != 0
    err = capsys.readouterr().err
    assert err == ("demo needs ml_dtypes (pip install 'numba-flash[bfloat16]') and ncu-not-here "
                   "(from the CUDA toolkit)\n")


def test_numba_flash_torch_without_torch_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "numba_flash.torch", raising=False)
    with pytest.raises(ImportError, match=r"numba_flash.torch needs torch \(pip install 'numba-flash\[torch\]'\)") as err:
        importlib.import_module("numba_flash.torch")
    assert type(err.value) is ImportError  # not a bare ModuleNotFoundError
